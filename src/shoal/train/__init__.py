"""Training signals for on-policy distillation: IER token selection, TIP / TA-OPD, ExOPD and MOPD."""
