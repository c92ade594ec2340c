"""``gc_fused`` with ``compressor=none`` against Lightning's ``ddp`` on the patterns users train with.

Each case trains the same seed and data under both strategies on 2 gloo ranks (fork launcher) and
compares every rank's parameters and buffers with the same rank's under ``ddp``. Tolerance: 1e-6
absolute (DDP divides each gradient by the world size before its allreduce, the synchroniser after
its sum: the same average up to fp32 rounding), 1e-5 under bf16-mixed.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from models import fit, synthetic_images
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader

from gc_strategy import GCFusedStrategy

pytestmark = pytest.mark.slow


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x))) + x


class Net(nn.Module):
    """Stem, two residual blocks with BatchNorm, a head; optionally a branch no rank uses and a
    branch only rank 0 uses."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.Sequential(Block(8), Block(8))
        self.head = nn.Linear(8, 10)
        self.never = nn.Linear(8, 10)
        self.rank0_only = nn.Linear(8, 10)


class ParityLM(pl.LightningModule):
    def __init__(
        self,
        optimizer: str = "sgd",
        checkpointing: str | None = None,
        reentrant: bool = True,
        frozen_head: bool = False,
        branches: bool = False,
        compiled: bool = False,
        manual: bool = False,
    ) -> None:
        super().__init__()
        self.net = Net()
        self.optimizer, self.checkpointing, self.reentrant = optimizer, checkpointing, reentrant
        self.branches, self.manual = branches, manual
        if not branches:
            self.net.never.requires_grad_(False)
            self.net.rank0_only.requires_grad_(False)
        if frozen_head:
            self.net.head.requires_grad_(False)
        if compiled:
            self.net.blocks[1] = torch.compile(self.net.blocks[1], backend="aot_eager")
        self.automatic_optimization = not manual
        self.losses: list[float] = []

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``checkpointing="whole"``: one checkpoint over the whole model; ``"layers"``: one per
        layer, the head (nearest the loss) included, as Hugging Face's gradient checkpointing does.
        Either way the first gradients of a backward arrive inside a nested backward in the
        reentrant mode, and in ``"layers"`` more follow in the enclosing one."""
        if self.checkpointing == "whole":  # the input requires grad, as enable_input_require_grads arranges
            return checkpoint(self._whole, x.requires_grad_(), use_reentrant=self.reentrant)
        if self.checkpointing == "layers":
            h = torch.relu(self.net.stem(x))
            for block in self.net.blocks:
                h = checkpoint(block, h, use_reentrant=self.reentrant)
            return checkpoint(self._head, h, use_reentrant=self.reentrant)
        return self._whole(x)

    def _whole(self, x: torch.Tensor) -> torch.Tensor:
        return self._head(self.net.blocks(torch.relu(self.net.stem(x))))

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        h = h.mean(dim=(2, 3))
        logits = self.net.head(h)
        if self.branches and self.global_rank == 0:
            logits = logits + self.net.rank0_only(h)
        return logits

    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.logits(x), y)

    def training_step(self, batch, batch_idx):
        if not self.manual:
            loss = self.loss(batch)
            self.losses.append(loss.item())
            return loss
        # two optimizers, alternating, as in a GAN: the trunk and head with the first, the stem's own with the second
        first, second = self.optimizers()
        for optimizer in (first, second):
            self.toggle_optimizer(optimizer)
            self.manual_backward(self.loss(batch))
            optimizer.step()
            optimizer.zero_grad()
            self.untoggle_optimizer(optimizer)

    def configure_optimizers(self):
        trainable = [p for p in self.parameters() if p.requires_grad]
        if self.manual:
            stem = list(self.net.stem.parameters())
            rest = [p for p in trainable if all(p is not s for s in stem)]
            return torch.optim.SGD(rest, lr=0.05, momentum=0.9), torch.optim.SGD(stem, lr=0.05)
        if self.optimizer == "adamw":
            return torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.1)
        return torch.optim.SGD(trainable, lr=0.05, momentum=0.9, weight_decay=1e-2)

    def train_dataloader(self):
        return DataLoader(synthetic_images(64), batch_size=8, shuffle=False)


class SaveEveryRank(Callback):
    """At the end of training each rank writes its parameters and buffers to ``folder/rank{r}.pt``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_end(self, trainer, pl_module) -> None:
        state = {name: t.detach().clone() for name, t in pl_module.state_dict().items()}
        state["losses"] = torch.tensor(pl_module.losses)
        torch.save(state, self.folder / f"rank{trainer.global_rank}.pt")


def _run(folder: Path, strategy, module_kwargs=None, ckpt_path=None, callbacks=(), devices=2, **trainer_kwargs):
    folder.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0, verbose=False)
    module = ParityLM(**(module_kwargs or {}))
    fit(
        module,
        strategy,
        ckpt_path=ckpt_path,
        callbacks=[SaveEveryRank(folder), *callbacks],
        devices=devices,
        **trainer_kwargs,
    )
    return [torch.load(folder / f"rank{r}.pt") for r in range(devices)]


def _differences(ours: list[dict], reference: list[dict], buffers: bool = True) -> list[float]:
    """The largest difference of any parameter (and buffer), per rank."""
    out = []
    for mine, theirs in zip(ours, reference):
        assert mine.keys() == theirs.keys()
        keys = [k for k in mine if k != "losses" and (buffers or "running" not in k and "num_batches" not in k)]
        out.append(max((mine[k].double() - theirs[k].double()).abs().max().item() for k in keys))
    return out


def _assert_parity(
    tmp_path,
    module_kwargs=None,
    ddp="ddp_fork",
    ddp_options=None,
    options=None,
    tolerance=1e-6,
    buffers=True,
    **trainer_kwargs,
):
    reference = _run(tmp_path / "ddp", _ddp(ddp, ddp_options), module_kwargs, **trainer_kwargs)
    ours = _run(
        tmp_path / "gc",
        GCFusedStrategy(start_method="fork", fusion="groups:3", **(options or {})),
        module_kwargs,
        **trainer_kwargs,
    )
    differences = _differences(ours, reference, buffers)
    assert max(differences) <= tolerance, differences
    return ours, reference


def _ddp(name, options):
    if not options:
        return name
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(start_method="fork", **options)


def test_plain_training(tmp_path):
    ours, _ = _assert_parity(tmp_path)
    assert any(not torch.equal(ours[0][k], ours[1][k]) for k in ours[0] if "running" in k)  # buffers differ by rank


def test_node_hierarchy_on_one_node(tmp_path):
    """hierarchy="node" with the Trainer's one node of 2 devices (a reduce to each bucket's owner,
    then a broadcast): the same training as ddp on every rank, to fp32 rounding."""
    _assert_parity(tmp_path, options=dict(hierarchy="node"))


def test_gradient_accumulation_and_clipping(tmp_path):
    _assert_parity(tmp_path, accumulate_grad_batches=2, gradient_clip_val=0.05)
    _assert_parity(tmp_path / "value", gradient_clip_val=0.01, gradient_clip_algorithm="value")


def test_bf16_mixed(tmp_path):
    _assert_parity(tmp_path, precision="bf16-mixed", tolerance=1e-5)


def test_manual_optimization_with_two_toggled_optimizers(tmp_path):
    # Toggling freezes the other optimizer's parameters, so DDP needs find_unused_parameters too.
    # Parameters only: under manual optimization Lightning's forward redirection turns DDP's backward
    # sync off around each step's forward, so DDP broadcasts the buffers before the first step only;
    # the synchroniser broadcasts them before every step (BatchNorm trains on batch statistics, so
    # the parameters do not depend on it).
    _assert_parity(
        tmp_path,
        dict(manual=True),
        ddp="ddp_fork_find_unused_parameters_true",
        options=dict(find_unused_parameters=True),
        buffers=False,
    )


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_unused_parameters_keep_none_like_ddp(tmp_path, optimizer):
    kwargs = dict(branches=True, optimizer=optimizer)
    pl.seed_everything(0, verbose=False)
    initial = ParityLM(**kwargs).state_dict()
    ours, _ = _assert_parity(
        tmp_path, kwargs, ddp="ddp_fork_find_unused_parameters_true", options=dict(find_unused_parameters=True)
    )
    for rank in range(2):  # no rank used it: weight decay and momentum must not have moved it
        assert torch.equal(ours[rank]["net.never.weight"], initial["net.never.weight"])
        assert not torch.equal(ours[rank]["net.rank0_only.weight"], initial["net.rank0_only.weight"])


def test_unused_parameters_without_the_option_are_an_error(tmp_path):
    with pytest.raises(Exception, match="find_unused_parameters=True"):
        _run(tmp_path, GCFusedStrategy(start_method="fork"), dict(branches=True))


@pytest.mark.parametrize("broadcast_buffers", [True, False])
def test_batchnorm_buffers(tmp_path, broadcast_buffers):
    ours, _ = _assert_parity(
        tmp_path,
        ddp_options=dict(broadcast_buffers=broadcast_buffers),
        options=dict(broadcast_buffers=broadcast_buffers),
    )
    mean = "net.blocks.0.bn.running_mean"
    assert not torch.equal(ours[0][mean], ours[1][mean])  # each rank's last forward updated its copy


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize(
    "checkpointing, frozen_head",
    [("whole", False), ("layers", False), ("layers", True)],
    ids=["whole", "layers", "layers-frozen-head"],
)
def test_activation_checkpointing(tmp_path, checkpointing, frozen_head, reentrant):
    kwargs = dict(checkpointing=checkpointing, frozen_head=frozen_head, reentrant=reentrant)
    ours, _ = _assert_parity(tmp_path, kwargs)
    pl.seed_everything(0, verbose=False)
    initial = ParityLM(**kwargs).state_dict()
    assert not torch.equal(ours[0]["net.stem.weight"], initial["net.stem.weight"])  # the trunk trained


def test_compiled_submodule(tmp_path):
    _assert_parity(tmp_path, dict(compiled=True))


def test_resume_from_last_checkpoint(tmp_path):
    reference = _run(tmp_path / "ddp", "ddp_fork", max_epochs=2)
    saved = tmp_path / "ckpt"
    _run(
        tmp_path / "first",
        GCFusedStrategy(start_method="fork"),
        max_epochs=1,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=saved, save_last=True)],
    )
    resumed = _run(
        tmp_path / "resumed", GCFusedStrategy(start_method="fork"), max_epochs=2, ckpt_path=str(saved / "last.ckpt")
    )
    assert max(_differences(resumed, reference)) <= 1e-6


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2), (2, 3)], ids=["2to1", "1to2", "2to3"])
def test_resume_on_another_world_size(tmp_path, before, after):
    """compressor=none resumed on another number of ranks equals ddp resumed the same way."""
    results = {}
    for name, strategy in (("ddp", lambda: "ddp_fork"), ("gc", lambda: GCFusedStrategy(start_method="fork"))):
        saved = tmp_path / name / "ckpt"
        _run(
            tmp_path / name / "first",
            strategy(),
            devices=before,
            max_epochs=1,
            enable_checkpointing=True,
            callbacks=[ModelCheckpoint(dirpath=saved, save_last=True)],
        )
        results[name] = _run(
            tmp_path / name / "resumed", strategy(), devices=after, max_epochs=2, ckpt_path=str(saved / "last.ckpt")
        )
    assert max(_differences(results["gc"], results["ddp"])) <= 1e-6


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2), (2, 3)], ids=["2to1", "1to2", "2to3"])
def test_a_compressed_run_resumes_on_another_world_size(tmp_path, before, after):
    """top-k with residual memory: the resumed run's second-epoch loss stays close to the
    uninterrupted run's (the residuals are resharded by the mean rule, not dropped)."""

    def strategy():
        return GCFusedStrategy(start_method="fork", compressor="topk", memory="residual", density=0.05)

    straight = _run(tmp_path / "straight", strategy(), devices=before, max_epochs=2)
    saved = tmp_path / "ckpt"
    _run(
        tmp_path / "first",
        strategy(),
        devices=before,
        max_epochs=1,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=saved, save_last=True)],
    )
    resumed = _run(tmp_path / "resumed", strategy(), devices=after, max_epochs=2, ckpt_path=str(saved / "last.ckpt"))

    def second_epoch_loss(ranks, world_size):
        steps = 64 // (8 * world_size) + (64 % (8 * world_size) > 0)
        return sum(float(r["losses"][-steps:].mean()) for r in ranks) / len(ranks)

    continued, uninterrupted = second_epoch_loss(resumed, after), second_epoch_loss(straight, before)
    assert abs(continued - uninterrupted) <= 0.1 * uninterrupted, (continued, uninterrupted)
