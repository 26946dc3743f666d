"""The preference-loss driver runs any formula of per-sequence log-probs (here a loss none of the ops offers) chunked,
with the shared checks and the fallback; the loss modules take their op's options, by position or name."""

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.helpers import IGNORE, assert_close, leaves, make_inputs
from tigon.kernels import modules, reference
from tigon.kernels.ops.fused_linear_preference import (
    Batch,
    ChunkLoss,
    PassResult,
    PreferenceLoss,
    fused_linear_preference,
)
from tigon.kernels.utils import use_triton


def margin_reference(hidden, weight, target, bias=None, *, margin, ignore_index=-100):
    """The margin loss on the full logits: mean over pairs of softplus(margin - (logp_c - logp_r))."""
    logps, _ = reference.sequence_logps(hidden, weight, target, bias, ignore_index=ignore_index)
    pairs = hidden.shape[0] // 2
    difference = logps[:pairs] - logps[pairs:]
    return F.softplus(margin - difference).mean(), {"differences": difference.detach()}


@dataclass(frozen=True)
class Margin(PreferenceLoss):
    margin: float

    NAME = "margin_loss"
    REFERENCE = staticmethod(margin_reference)

    def check(self, batch: Batch) -> None:
        if self.margin < 0:
            raise ValueError(f"margin={self.margin} must be >= 0")

    def chunk_loss(self, batch: Batch) -> ChunkLoss:
        margin, pairs = self.margin, batch.pairs

        def loss_fn(logps, counts, ref, rows):
            k = logps.shape[0] // 2
            return F.softplus(margin - (logps[:k] - logps[k:])).sum() / pairs

        return loss_fn

    def metrics(self, batch: Batch, result: PassResult) -> dict[str, torch.Tensor]:
        return {"differences": (result.logps[: batch.pairs] - result.logps[batch.pairs :]).float()}


def run_margin(h, w, target, b, margin=0.5, chunk_size=None, dispatch=use_triton):
    settings = {"ignore_index": IGNORE, "check_targets": True, "accumulate_in_fp32": False, "chunk_size": chunk_size}
    return fused_linear_preference(Margin(margin), h, w, target, b, **settings, use_triton=dispatch)


@pytest.mark.parametrize("chunk_size", [None, 1, 2])
def test_a_new_loss_runs_chunked_against_float64_autograd(chunk_size, device):
    h, w, b, target = make_inputs(6, 7, 16, 53, torch.float32, device, 12)
    hl, wl, bl = leaves(h, w, b)
    h64, w64, b64 = leaves(h, w, b, dtype=torch.float64)
    loss, metrics = run_margin(hl, wl, target, bl, chunk_size=chunk_size)
    ref_loss, ref_metrics = margin_reference(h64, w64, target, b64, margin=0.5, ignore_index=IGNORE)
    loss.backward()
    ref_loss.backward()
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert_close(loss, ref_loss, torch.float32, "margin loss")
    assert_close(metrics["differences"], ref_metrics["differences"], torch.float32, "differences")
    assert not metrics["differences"].requires_grad
    for ours, theirs, what in ((hl, h64, "dhidden"), (wl, w64, "dweight"), (bl, b64, "dbias")):
        assert_close(ours.grad, theirs.grad, torch.float32, what)


def test_the_fallback_gets_the_options_and_the_op_name(device):
    h, w, b, target = make_inputs(4, 5, 8, 19, torch.float32, device, 13)
    asked = []

    def no_kernels(op, tensor):
        asked.append(op)
        return False

    loss, metrics = run_margin(h, w, target, b, margin=1.5, dispatch=no_kernels)
    expected, expected_metrics = margin_reference(h, w, target, b, margin=1.5, ignore_index=IGNORE)
    assert asked == ["margin_loss"]
    assert torch.equal(loss, expected) and torch.equal(metrics["differences"], expected_metrics["differences"])


def test_shared_checks_come_before_the_loss_checks(device):
    h, w, b, target = make_inputs(4, 5, 8, 19, torch.float32, device, 14)
    with pytest.raises(ValueError, match="margin=-1.0 must be >= 0"):
        run_margin(h, w, target, b, margin=-1.0)
    with pytest.raises(ValueError, match="count must be even"):
        run_margin(h[:3], w, target[:3], b, margin=-1.0)


MODULE_OPTIONS = {
    modules.FusedLinearDPOLoss: {
        "beta": 0.1, "label_smoothing": 0.0, "loss_type": "sigmoid", "loss_weights": None, "average_log_prob": False,
        "rpo_alpha": None, "discopop_tau": 0.05, "ignore_index": -100, "chunk_size": None,
    },
    modules.FusedLinearCPOLoss: {
        "beta": 0.1, "alpha": 1.0, "label_smoothing": 0.0, "ignore_index": -100, "chunk_size": None,
    },
    modules.FusedLinearSimPOLoss: {
        "beta": 2.0, "gamma": 0.5, "alpha": 0.0, "label_smoothing": 0.0, "ignore_index": -100, "chunk_size": None,
    },
    modules.FusedLinearORPOLoss: {"beta": 0.1, "ignore_index": -100, "chunk_size": None},
    modules.FusedLinearKTOLoss: {
        "beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0, "loss_type": "kto",
        "average_log_prob": False, "ignore_index": -100, "chunk_size": None,
    },
}  # fmt: skip


@pytest.mark.parametrize("module", list(MODULE_OPTIONS), ids=lambda module: module.__name__)
def test_modules_take_their_ops_options_by_position_or_name(module):
    defaults = MODULE_OPTIONS[module]
    assert list(module().options.items()) == list(defaults.items())
    names = list(defaults)
    by_position = module(0.7, *list(defaults.values())[1:-1], 3)
    assert by_position.options == {**defaults, names[0]: 0.7, "chunk_size": 3}
    assert module(chunk_size=3, beta=0.7).options == by_position.options
    with pytest.raises(TypeError, match="betta"):
        module(betta=0.7)
    with pytest.raises(TypeError, match="too many positional arguments"):
        module(*defaults.values(), 1)
