"""`use_tigon` on TRL's trainers: the same per-step losses and metrics as TRL's own, with no full logits built."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.runtime.configs import PAIRS, tiny_model_dir, trl_trainer
from tigon.kernels.integrations import use_tigon
from tigon.kernels.trl_losses import UnsupportedByTigon

trl = pytest.importorskip("trl")

pytestmark = pytest.mark.usefixtures("one_thread")
STEPS = 2
# The fused losses alone (the layer kernels through the Triton interpreter are slow, and tested on their own), with
# one pair (or sequence) a chunk at these lengths, so a micro-batch takes several chunks
TIGON = functools.partial(use_tigon, rms_norm=False, rope=False, swiglu=False, loss_chunk_tokens=16)
PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


class LogitRows(TorchDispatchMode):
    """Records, over everything run inside it, the most rows of any tensor allocated with the vocabulary as its last
    dimension (a logits tensor or a chunk of one; views, such as the head's weight transposed, are not allocations)
    and the fewest tokens a forward embedded (a micro-batch's rows x length)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.most_logit_rows, self.fewest_tokens = vocab, 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dim() >= 2:
            if out.shape[-1] == self.vocab and out.is_floating_point() and not out._is_view():
                self.most_logit_rows = max(self.most_logit_rows, out.numel() // self.vocab)
            if func is torch.ops.aten.embedding.default:
                tokens = out.numel() // out.shape[-1]
                self.fewest_tokens = tokens if self.fewest_tokens is None else min(self.fewest_tokens, tokens)
        return out


def tigon_and_trl(
    tmp_path, config_class, trainer_class, records, **settings
) -> tuple[list, list, LogitRows, LogitRows]:
    """The same TRL run with use_tigon and without: (tigon's step logs, TRL's, what each built while training)."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_model_dir(tmp_path)).vocab_size
    runs = []
    for prepare in (TIGON, None):
        run_dir = tmp_path / ("tigon" if prepare else "trl")
        trainer = trl_trainer(run_dir, config_class, trainer_class, records, max_steps=STEPS, **settings)
        if prepare is not None:
            prepare(trainer)
        with LogitRows(vocab) as watch:
            trainer.train()
        runs.append(([record for record in trainer.state.log_history if "loss" in record], watch))
    (ours, our_watch), (theirs, their_watch) = runs
    assert len(ours) == len(theirs) == STEPS
    # No tensor holds the logits of a whole micro-batch: at most a chunk of it
    assert 0 < our_watch.most_logit_rows < our_watch.fewest_tokens, (our_watch.most_logit_rows, our_watch.fewest_tokens)
    return ours, theirs, our_watch, their_watch


def close(ours: list[dict], theirs: list[dict], names, relative: float, absolute: float) -> None:
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True), 1):
        for name in names:
            assert abs(a[name] - b[name]) <= max(relative * abs(b[name]), absolute), (step, name, a[name], b[name])


# Tolerances: float32 on both sides, the same math summed in different orders (tigon's chunked kernels through the
# Triton interpreter and float64 per-sequence sums, TRL's torch ops). Measured over these runs: losses and log-probs
# within 4e-7 relative, mean logits 4e-6, rewards 4e-6 (and margins, near 0, 1e-6 absolute), gradient norms 4e-7.
# Asserted: 1e-5 relative (1e-6 absolute floor) on losses, log-probs and mean logits; 1e-5 relative or absolute on
# rewards, the KL estimate and gradient norms.


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"precompute_ref_log_probs": True, "loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]},
        {"precompute_ref_log_probs": True, "loss_type": ["aot", "aot_unpaired"], "loss_weights": [1.0, 0.5]},
    ],
    ids=["reference-model", "precomputed-sigmoid-and-sft", "precomputed-aot-types"],
)
def test_dpo_trainer_with_tigon_logs_trls_losses_and_metrics(tmp_path, settings):
    ours, theirs, _, _ = tigon_and_trl(tmp_path, trl.DPOConfig, trl.DPOTrainer, PAIRS, beta=0.1, **settings)
    close(ours, theirs, ["loss", "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected"], 1e-5, 1e-6)
    close(ours, theirs, ["rewards/chosen", "rewards/rejected", "rewards/margins", "grad_norm"], 1e-5, 1e-5)
    # From the second step: at the first the policy is its reference, each reward is 0 up to the last float bit, and
    # against precomputed reference log-probs a tie breaks either way
    assert [a["rewards/accuracies"] for a in ours[1:]] == [b["rewards/accuracies"] for b in theirs[1:]]
    assert [a["num_tokens"] for a in ours] == [b["num_tokens"] for b in theirs]
    assert "entropy" not in ours[0] and "mean_token_accuracy" not in ours[0]


def test_dpo_trainer_with_a_lora_adapter_takes_its_reference_from_the_base_model(tmp_path):
    """No reference model with PEFT: the reference log-probs come from the model with its adapter disabled."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    ours, theirs, _, _ = tigon_and_trl(tmp_path, trl.DPOConfig, trl.DPOTrainer, PAIRS, peft_config=lora)
    close(ours, theirs, ["loss", "logps/chosen", "logps/rejected"], 1e-5, 1e-6)
    close(ours, theirs, ["rewards/chosen", "rewards/rejected", "rewards/margins"], 1e-5, 1e-5)
    assert ours[-1]["rewards/margins"] != 0.0  # the adapter trained away from its reference


def test_kto_trainer_with_tigon_logs_trls_losses_and_metrics(tmp_path):
    """One micro-batch of 8 per step: TRL's KL reference point is a mean over the micro-batch."""
    records = [
        {"prompt": pair["prompt"], "completion": pair["chosen" if i % 2 else "rejected"], "label": bool(i % 2)}
        for i, pair in enumerate(PAIRS)
    ]
    ours, theirs, _, _ = tigon_and_trl(
        tmp_path, trl.KTOConfig, trl.KTOTrainer, records, per_device_train_batch_size=8, gradient_accumulation_steps=1
    )
    close(ours, theirs, ["loss", "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected"], 1e-5, 1e-6)
    close(ours, theirs, ["rewards/chosen", "rewards/rejected", "rewards/margins", "kl", "grad_norm"], 1e-5, 1e-5)
    assert any(step["kl"] > 0 for step in ours)


@pytest.mark.parametrize("loss_type", ["nll", "dft"])
def test_sft_trainer_with_tigon_logs_trls_loss_and_token_accuracy(tmp_path, loss_type):
    """Prompt-completion rows of different lengths, 2 micro-batches a step (`num_items_in_batch` normalizes); DFT
    weighs each token's loss by its probability, the fused op's token scaling."""
    records = [{"prompt": pair["prompt"], "completion": pair["chosen"]} for pair in PAIRS]
    ours, theirs, _, _ = tigon_and_trl(tmp_path, trl.SFTConfig, trl.SFTTrainer, records, loss_type=loss_type)
    close(ours, theirs, ["loss", "mean_token_accuracy"], 1e-5, 1e-6)
    close(ours, theirs, ["grad_norm"], 1e-5, 1e-5)
    assert [a["num_tokens"] for a in ours] == [b["num_tokens"] for b in theirs]


@pytest.mark.parametrize(
    "settings",
    [{"beta": 0.1, "cpo_alpha": 1.0}, {"beta": 2.0, "cpo_alpha": 0.0, "loss_type": "simpo", "simpo_gamma": 0.5}],
    ids=["cpo", "simpo"],
)
def test_cpo_trainer_with_tigon_logs_trls_losses_and_metrics(tmp_path, settings):
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    ours, theirs, _, their_watch = tigon_and_trl(tmp_path, CPOConfig, CPOTrainer, PAIRS, **settings)
    close(ours, theirs, ["loss", "logps/chosen", "logps/rejected", "nll_loss"], 1e-5, 1e-6)
    close(ours, theirs, [*PAIR_METRICS[:3], "grad_norm"], 1e-5, 1e-5)
    assert [a["rewards/accuracies"] for a in ours] == [b["rewards/accuracies"] for b in theirs]
    assert their_watch.most_logit_rows >= their_watch.fewest_tokens  # TRL alone builds the logits: the check can fail


def test_orpo_trainer_with_tigon_logs_trls_losses_and_metrics(tmp_path):
    """ORPO's NLL term over the chosen prompt and completion, as TRL's ORPOTrainer takes it."""
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    ours, theirs, _, their_watch = tigon_and_trl(tmp_path, ORPOConfig, ORPOTrainer, PAIRS, beta=0.1)
    names = ["loss", "logps/chosen", "logps/rejected", "nll_loss", "log_odds_ratio", "log_odds_chosen"]
    close(ours, theirs, names, 1e-5, 1e-6)
    close(ours, theirs, [*PAIR_METRICS[:3], "grad_norm"], 1e-5, 1e-5)
    assert [a["rewards/accuracies"] for a in ours] == [b["rewards/accuracies"] for b in theirs]
    assert their_watch.most_logit_rows >= their_watch.fewest_tokens


def test_settings_tigon_cannot_compute_raise_with_the_fix(tmp_path):
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    cases = [
        (trl.DPOConfig, trl.DPOTrainer, {"use_weighting": True}, "DPOConfig.use_weighting=True .* set use_weighting"),
        (trl.DPOConfig, trl.DPOTrainer, {"ld_alpha": 0.5}, r"DPOConfig.ld_alpha=0.5 .* set ld_alpha=None"),
        (CPOConfig, CPOTrainer, {"loss_type": "ipo"}, "CPOConfig.loss_type='ipo' .* use loss_type 'sigmoid'"),
        (CPOConfig, CPOTrainer, {"alpha": 0.5}, r"CPOConfig.alpha=0.5 \(AlphaPO's reward\) .* set alpha=0.0"),
    ]
    for config_class, trainer_class, settings, message in cases:
        trainer = trl_trainer(tmp_path, config_class, trainer_class, PAIRS, **settings)
        with pytest.raises(UnsupportedByTigon, match=message):
            use_tigon(trainer)
        assert "compute_loss" not in vars(trainer) and "_compute_loss" not in vars(trainer)
    records = [{"prompt": pair["prompt"], "completion": pair["chosen"]} for pair in PAIRS]
    trainer = trl_trainer(tmp_path, trl.SFTConfig, trl.SFTTrainer, records, label_smoothing_factor=0.1)
    with pytest.raises(UnsupportedByTigon, match="label_smoothing_factor > 0 .* set label_smoothing_factor=0.0"):
        use_tigon(trainer)


def test_use_tigon_patches_the_policy_and_the_reference_model(tmp_path):
    """DPO: the kernels go into the trained model and into the reference model; a plain HF Trainer gets the patched
    forward, whose loss is the fused cross entropy."""
    import transformers

    from tigon.kernels.modules import RMSNorm

    trainer = trl_trainer(tmp_path, trl.DPOConfig, trl.DPOTrainer, PAIRS)
    report = use_tigon(trainer, rope=False)
    assert trainer.tigon_kind == "dpo" and "_compute_loss" in vars(trainer)
    assert report.applied == {"rms_norm": 5, "gated_mlp": 2, "fused_linear_cross_entropy": 1}
    for model in (trainer.model, trainer.ref_model):
        assert sum(isinstance(module, RMSNorm) for module in model.modules()) == 5
    plain = transformers.Trainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir(tmp_path)),
        args=transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), report_to=[], use_cpu=True),
    )
    assert use_tigon(plain, rope=False).applied["fused_linear_cross_entropy"] == 1 and plain.tigon_kind == "hf"
