"""The accuracy study's instruments, run from the checkout as ``python -m scripts.experiments.<name>``; their
research recipes are in ``recipes/experiments/`` and the study's report is ``docs/accuracy.md``.

* :mod:`.fidelity`            gradient and weight error of each qgZ/qwZ option along a real training trajectory;
* :mod:`.quantizer_floor`     how low the per-step gradient error can go at the inter-node hop's bytes (theory);
* :mod:`.report_convergence`  final validation loss per configuration over seeds, with confidence intervals;
* ``run_mini_convergence.sh`` the mini Table 5 sweep (every recipe x seed), then the report.
"""
