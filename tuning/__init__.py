"""The autotuner (Optuna studies per tuning key) and the per-device results tables."""
