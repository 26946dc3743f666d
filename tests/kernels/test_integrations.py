"""HF Trainer and Lightning callbacks: the same per-step losses as applying the kernels by hand."""

import copy

import pytest
import torch

from tests.kernels.families import rope_functions, rope_functions_set, tiny
from tigon.kernels import integrations
from tigon.kernels.patching import apply

transformers = pytest.importorskip("transformers")

STEPS = 2


def labelled_rows(n: int = 8, length: int = 12) -> list[dict]:
    """Fixed token rows whose label counts differ, so a mean of micro-batch means would differ from the token mean."""
    generator = torch.Generator().manual_seed(3)
    rows = []
    for i in range(n):
        ids = torch.randint(1, 131, (length,), generator=generator)
        labels = ids.clone()
        labels[: 1 + 2 * (i % 5)] = -100  # prompts of different lengths carry no loss
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def hf_losses(model, tmp_path, callbacks=()) -> list[float]:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=labelled_rows(), callbacks=list(callbacks))
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_hf_trainer_callback_matches_kernels_applied_by_hand(tmp_path, restore_rope):
    """The unpatched run takes transformers' own RoPE (tigon's patch of it is module-wide)."""
    baseline = tiny("llama")
    ropes = rope_functions()
    by_hand = copy.deepcopy(baseline)
    apply(by_hand)
    callback = integrations.HFCallback()
    with_callback = copy.deepcopy(baseline)
    callback_losses = hf_losses(with_callback, tmp_path / "callback", [callback])
    assert callback.report.applied["fused_linear_cross_entropy"] == 1
    assert with_callback.tigon_patch_report is callback.report
    hand_losses = hf_losses(by_hand, tmp_path / "hand")
    with rope_functions_set(ropes):
        plain_losses = hf_losses(baseline, tmp_path / "plain")
    assert len(callback_losses) == STEPS and callback_losses == hand_losses
    # Gradient accumulation with num_items_in_batch: the fused loss normalizes as transformers does.
    for ours, theirs in zip(callback_losses, plain_losses, strict=True):
        assert abs(ours - theirs) < 1e-5 * theirs
    for ours, theirs in zip(with_callback.parameters(), by_hand.parameters(), strict=True):
        assert torch.equal(ours, theirs)


def test_apply_to_trainer_patches_a_built_trainer(tmp_path, restore_rope):
    model = tiny("llama")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=1)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=labelled_rows(2))
    report = integrations.apply_to_trainer(trainer, swiglu=False)
    assert report.applied == {"rms_norm": 5, "rope": 1, "fused_linear_cross_entropy": 1}
    assert model.tigon_patch_report is report


def sft_first_step(model, tmp_path, callbacks=()) -> dict[str, float]:
    """TRL's SFTTrainer, one optimizer step (2 micro-batches of rows of different lengths): what it logs."""
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")
    from tigon.runtime.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    generator = torch.Generator().manual_seed(4)
    lengths = torch.randint(5, 17, (8,), generator=generator).tolist()
    rows = [{"input_ids": torch.randint(3, 131, (n,), generator=generator).tolist()} for n in lengths]
    args = trl.SFTConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=1,
        logging_steps=1,
        learning_rate=1e-2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    trainer = trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=list(callbacks),
    )
    trainer.train()
    (logged,) = [entry for entry in trainer.state.log_history if "loss" in entry]
    return logged


def test_trl_sft_trainer_with_the_callback_logs_what_it_logs_without(tmp_path, restore_rope):
    """TRL's SFTTrainer (which computes its loss, entropy and token accuracy with a fused LM head of its own) trains
    a patched model: the first step's loss, gradient norm, entropy and token accuracy equal the unpatched run's."""
    baseline = tiny("llama")
    patched = copy.deepcopy(baseline)
    callback = integrations.HFCallback()
    ours = sft_first_step(patched, tmp_path / "tigon", [callback])
    theirs = sft_first_step(baseline, tmp_path / "plain")
    assert callback.report.applied["rms_norm"] == 5 and callback.report.applied["gated_mlp"] == 2
    assert ours["num_tokens"] == theirs["num_tokens"] > 0
    # fp32 on the CPU (the kernels through the interpreter): the tolerances of the patching tests, 1e-5 for what
    # the forward computes and 1e-4 for gradients (measured 5.5e-6 on the loss and 2.5e-5 on the gradient norm)
    for name, tolerance in (("loss", 1e-5), ("entropy", 1e-5), ("mean_token_accuracy", 1e-5), ("grad_norm", 1e-4)):
        assert abs(ours[name] - theirs[name]) <= tolerance * max(abs(theirs[name]), 1e-3), (name, ours, theirs)


def lightning_losses(model, callbacks=()) -> list[float]:
    pl = pytest.importorskip("lightning.pytorch")

    class Module(pl.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.model, self.losses = model, []

        def training_step(self, batch, index):
            loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    rows = labelled_rows()
    loader = torch.utils.data.DataLoader(rows, batch_size=2, shuffle=False)
    module = Module(model)
    trainer = pl.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )
    trainer.fit(module, loader)
    return module.losses


def test_lightning_callback_matches_kernels_applied_by_hand(restore_rope):
    """The unpatched run takes transformers' own RoPE (tigon's patch of it is module-wide)."""
    baseline = tiny("llama")
    ropes = rope_functions()
    by_hand = copy.deepcopy(baseline)
    apply(by_hand)
    callback = integrations.LightningCallback()
    with_callback = copy.deepcopy(baseline)
    callback_losses = lightning_losses(with_callback, [callback])
    assert callback.report.applied["fused_linear_cross_entropy"] == 1
    assert type(with_callback).forward is not transformers.LlamaForCausalLM.forward
    hand_losses = lightning_losses(by_hand)
    with rope_functions_set(ropes):
        plain_losses = lightning_losses(baseline)
    assert len(callback_losses) == STEPS and callback_losses == hand_losses
    for ours, theirs in zip(callback_losses, plain_losses, strict=True):
        assert abs(ours - theirs) < 1e-5 * theirs


def test_lightning_callback_names_the_fix_without_a_hugging_face_model():
    with pytest.raises(ValueError, match="holds no Hugging Face model"):
        integrations.find_hf_model(torch.nn.Linear(2, 2))
