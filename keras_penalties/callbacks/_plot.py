"""`PenaltyMonitor.plot`'s figure, drawn from the monitor's probe history."""

import keras


def _pyplot():
    """matplotlib's pyplot on a non-interactive backend (unless one is set);
    an ImportError saying how to install it otherwise."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        from matplotlib import pyplot as plt
    except ImportError as error:
        raise ImportError("PenaltyMonitor.plot() needs matplotlib: pip install matplotlib") from error
    return plt


def _figure(plt, history, term_keys, grad_norms, every_n_batches):
    """Contributions, weighted gradient norms (with `grad_norms`) and the
    weights that changed, one panel each, over the probed steps."""
    steps = [entry["step"] for entry in history]
    # Weights that changed while training (schedules, adaptive methods) get a panel.
    moving = [k for k in term_keys if len({e[f"{k}/weight"] for e in history}) > 1]
    rows = 1 + grad_norms + bool(moving)
    figure, axes = plt.subplots(rows, 1, figsize=(8, 3.2 * rows), sharex=True, squeeze=False)
    for key in term_keys:
        axes[0, 0].plot(steps, [e[f"{key}/contribution"] for e in history], label=key)
    axes[0, 0].plot(steps, [e["base_loss"] for e in history], "k--", label="base_loss (compiled loss)")
    axes[0, 0].plot(steps, [e["total"] for e in history], "k", label="total (training loss)")
    axes[0, 0].set_ylabel("contribution to the loss\n(weight × term)")
    axes[0, 0].legend(fontsize="small")
    if grad_norms:
        for key in term_keys:
            axes[1, 0].plot(steps, [e[f"{key}/grad_norm_weighted"] for e in history], label=key)
        axes[1, 0].plot(steps, [e["base_loss/grad_norm"] for e in history], "k--", label="base_loss (compiled loss)")
        axes[1, 0].plot(steps, [e["total/grad_norm"] for e in history], "k", label="total (training loss)")
        axes[1, 0].set_yscale("log")
        axes[1, 0].set_ylabel("weighted gradient norm\n‖∂(w·term)/∂θ‖")
        axes[1, 0].legend(fontsize="small")
    if moving:
        for key in moving:
            axes[-1, 0].plot(steps, [e[f"{key}/weight"] for e in history], label=key)
        axes[-1, 0].set_ylabel("term weight")
        axes[-1, 0].legend(fontsize="small")
    axes[-1, 0].set_xlabel("training step (probes every %d batches)" % every_n_batches)
    figure.suptitle(f"Penalty terms while training ({keras.backend.backend()} backend)")
    figure.tight_layout()
    return figure
