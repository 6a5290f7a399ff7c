"""Training, off the serving path: distilled speculators (``distill``), the feature drafter
(``feature_distill``), the SSJF output-length predictor (``predictor``) and their commands
(``cli``: ``treeserve distill``, ``distill-features``, ``synth-prompts``, ``train-predictor``).
What serving loads of their results lives in ``ops`` (``ssm``, ``feature_drafter``,
``length_predictor``)."""
