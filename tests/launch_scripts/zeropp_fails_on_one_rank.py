"""An Accelerate script on hf_zeropp whose rank ``FAIL_RANK`` raises in its second step while the other ranks wait in
the forward's all-gather; they then fail with gloo's "Connection closed by peer", or are stopped by their launcher."""

import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from hf_zeropp import Accelerator

accelerator = Accelerator(zeropp="zeropp")
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
ids = torch.randint(0, 64, (2, 8))
for step in range(3):
    if step == 1 and accelerator.process_index == int(os.environ["FAIL_RANK"]):
        raise RuntimeError(f"rank {accelerator.process_index} fails on purpose")
    loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
