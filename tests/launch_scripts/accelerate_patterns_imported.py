"""accelerate_patterns.py the way a script is ported to hf_zeropp by hand: its Accelerator imported from hf_zeropp
(config from ZEROPP_CONFIG), plus the communication statistics of the first model."""

import accelerate_patterns

import hf_zeropp

if __name__ == "__main__":
    accelerate_patterns.main(hf_zeropp.Accelerator, report=hf_zeropp.comm_stats)
