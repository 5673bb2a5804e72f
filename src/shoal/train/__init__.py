"""Training signals for on-policy distillation: IER token selection, TIP / TA-OPD, ExOPD and MOPD.

Self-contained: nothing here imports the rest of shoal (sandboxes, rollouts), so it can be used
alone. It needs PyTorch (and for some modules transformers / TRL): the `shoal[train]` extra.
"""
try:
    import torch  # noqa: F401  (every module here computes with it)
except ImportError as e:
    raise ImportError("shoal.train needs PyTorch: pip install 'shoal[train]'") from e
