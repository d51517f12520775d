"""What DeepSpeed itself does, recorded as small fixtures for the main CI (tests/fixtures/deepspeed), which has no
DeepSpeed. Run these modules in .venv-deepspeed (scripts/benchmarks/deepspeed_env.sh) with DS_ACCELERATOR=cpu."""
