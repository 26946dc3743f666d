"""tigon's kernels and fused losses from a Hugging Face `Trainer`, a TRL trainer or a Lightning run, in one line.

    use_tigon(trainer)  # a built Trainer, SFTTrainer, DPOTrainer, KTOTrainer, ORPOTrainer or CPOTrainer
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[HFCallback()])
    # or, on a trainer already built:
    apply_to_trainer(trainer)

    lightning.Trainer(callbacks=[LightningCallback()]).fit(module)  # patches the module's HF model in `setup`

Keyword arguments (`rms_norm=False`, `fused_linear_cross_entropy=False`, ...) go to
`tigon.kernels.apply`. The patched forward keeps `**kwargs`, so the HF Trainer still passes
`num_items_in_batch` and gradient accumulation normalizes by the token count of the whole step.
transformers and lightning are imported only when their callback is first used.
"""

from __future__ import annotations

import functools

from torch import nn

from tigon.kernels.patching import PatchReport, apply

__all__ = ["HFCallback", "LightningCallback", "apply_to_trainer", "find_hf_model", "use_tigon"]  # noqa: F822 (module __getattr__)


def find_hf_model(module: nn.Module) -> nn.Module:
    """The first module inside `module` (itself included) with a transformers config, e.g. a LightningModule's model."""
    for candidate in module.modules():
        if hasattr(getattr(candidate, "config", None), "model_type"):
            return candidate
    raise ValueError(
        f"{type(module).__name__} holds no Hugging Face model (no submodule has a config with a model_type); "
        "apply tigon.kernels.apply(model) to the transformers model yourself"
    )


def apply_to_trainer(trainer, **options) -> PatchReport:
    """Apply the kernels to an HF `Trainer`'s model in place (before `trainer.train()`); returns the report."""
    report = apply(trainer.model, **options)
    trainer.model.tigon_patch_report = report
    return report


def use_tigon(trainer, **options) -> PatchReport:
    """Apply the kernels to a built trainer's model (and reference model) and, for a TRL trainer, make it compute its
    loss with tigon's fused linear ops (`tigon.kernels.trl_losses`); call before `trainer.train()`.

    A plain `transformers.Trainer` gets the patched forward, whose loss is the fused cross entropy. A TRL trainer
    setting the fused ops cannot compute exactly raises `UnsupportedByTigon` naming it and the fix. `options` go to
    `tigon.kernels.apply`; returns the model's report, also kept as `trainer.tigon_kind` ('hf', 'sft', 'dpo', ...).
    """
    kind = "hf"
    if any(base.__module__.startswith("trl.") for base in type(trainer).__mro__):
        from tigon.kernels.trl_losses import install

        kind = install(trainer)
    report = apply_to_trainer(trainer, **options)
    reference = getattr(trainer, "ref_model", None)
    if reference is not None:
        apply(trainer.accelerator.unwrap_model(reference), **options)
    trainer.tigon_kind = kind
    return report


@functools.cache
def _hf_callback_class() -> type:
    import transformers

    class HFCallback(transformers.TrainerCallback):
        """Applies tigon's kernels to the Trainer's model when the Trainer is built (`on_init_end`)."""

        def __init__(self, **options) -> None:
            self.options = options
            self.report: PatchReport | None = None

        def on_init_end(self, args, state, control, model=None, **kwargs):
            if model is None:
                raise ValueError("the Trainer has no model yet; pass model= to the Trainer that gets HFCallback")
            self.report = apply(model, **self.options)
            model.tigon_patch_report = self.report

    return HFCallback


@functools.cache
def _lightning_callback_class() -> type:
    import lightning.pytorch as pl

    class LightningCallback(pl.Callback):
        """Applies tigon's kernels to the Hugging Face model inside the LightningModule in `setup`."""

        def __init__(self, **options) -> None:
            self.options = options
            self.report: PatchReport | None = None

        def setup(self, trainer, pl_module, stage: str) -> None:
            if self.report is not None:  # setup runs once per stage (fit, validate, ...)
                return
            model = find_hf_model(pl_module)
            self.report = apply(model, **self.options)
            model.tigon_patch_report = self.report

    return LightningCallback


def __getattr__(name: str):
    if name == "HFCallback":
        return _hf_callback_class()
    if name == "LightningCallback":
        return _lightning_callback_class()
    raise AttributeError(f"module 'tigon.kernels.integrations' has no attribute {name!r}")
