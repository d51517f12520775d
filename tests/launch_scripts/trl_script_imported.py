"""TRL's own training scripts (``trl/scripts/sft.py``, ``dpo.py``) ported to hf_zeropp by hand: the script's trainer
with hf_zeropp's mixin in front, the config from ZEROPP_CONFIG. Each script imports its trainer from trl when it
runs, so naming the ported class there is the one-line edit a user makes in a copy of the script.

    python trl_script_imported.py sft|dpo ARGS...
"""

import importlib
import sys

import trl

import hf_zeropp

TRAINERS = {"sft": "SFTTrainer", "dpo": "DPOTrainer"}

if __name__ == "__main__":
    kind = sys.argv.pop(1)
    name = TRAINERS[kind]
    setattr(trl, name, type(name, (hf_zeropp.ZeroPPTrainerMixin, getattr(trl, name)), {}))
    script = importlib.import_module(f"trl.scripts.{kind}")
    script.main(*script.make_parser().parse_args_and_config(fail_with_unknown_args=False))
