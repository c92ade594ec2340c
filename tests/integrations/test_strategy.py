"""GCFusedStrategy inside Lightning, 2 gloo ranks (fork launcher), against Lightning's own ``ddp``."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from locations import TESTS
from models import ParityModule, fit, flat_params

from gc_strategy import GCFusedStrategy, NodeHierarchy
from gc_strategy.tools.ranks import run_ranks

pytestmark = pytest.mark.slow


def _train(strategy, seed=0, module_kwargs=None, **trainer_kwargs):
    pl.seed_everything(seed, verbose=False)
    module = ParityModule(**(module_kwargs or {}))
    fit(module, strategy, **trainer_kwargs)
    return module


@pytest.fixture(scope="module")
def ddp_reference():
    return flat_params(_train("ddp_fork"))


@pytest.mark.parametrize("fusion", ["layerwise", "single", "groups:1", "groups:3", "bucket_mb:0.002", "bucket_mb:25"])
def test_none_equals_lightning_ddp(ddp_reference, fusion):
    module = _train(GCFusedStrategy(fusion=fusion, start_method="fork"))
    assert (flat_params(module) - ddp_reference).abs().max() <= 1e-6


def test_registered_name_works_after_import():
    module = _train("gc_fused_fork")
    reference = _train("ddp_fork")
    assert (flat_params(module) - flat_params(reference)).abs().max() <= 1e-6


class CountingModule(ParityModule):
    """Checks in every rank that the synchroniser ran exactly once per optimizer step."""

    expected_steps = 2  # 64 samples / 2 ranks / batch 8 = 4 micro-batches, 2 per step

    def on_train_end(self):
        super().on_train_end()
        synchronizer = self.trainer.strategy.synchronizer
        assert self.trainer.global_step == self.expected_steps, self.trainer.global_step
        assert synchronizer.step == self.expected_steps, synchronizer.step
        assert synchronizer.telemetry.steps == self.expected_steps


def test_gradient_accumulation_syncs_only_on_stepping_micro_batches():
    pl.seed_everything(0, verbose=False)
    reference = ParityModule()
    fit(reference, "ddp_fork", accumulate_grad_batches=2)
    pl.seed_everything(0, verbose=False)
    module = CountingModule()
    fit(module, GCFusedStrategy(fusion="groups:2", start_method="fork"), accumulate_grad_batches=2)
    assert (flat_params(module) - flat_params(reference)).abs().max() <= 1e-6


def test_unused_and_frozen_parameters_match_ddp_and_the_unused_keep_no_gradient():
    kwargs = dict(with_unused=True, frozen_stem=True)
    before = ParityModule(**kwargs)
    module = _train(
        GCFusedStrategy(start_method="fork", fusion="layerwise", find_unused_parameters=True), module_kwargs=kwargs
    )
    reference = _train("ddp_fork_find_unused_parameters_true", module_kwargs=kwargs)
    assert torch.equal(module.net.conv1.weight, before.net.conv1.weight)  # frozen: untouched, same seed
    assert torch.equal(module.net.unused.weight, before.net.unused.weight)  # unused: momentum never moved it
    diff = max((a - b).abs().max() for a, b in zip(module.parameters(), reference.parameters()))
    assert diff <= 1e-6


class ValidatedModule(ParityModule):
    def validation_step(self, batch, batch_idx):
        return self.training_step(batch, batch_idx)

    def val_dataloader(self):
        return self.train_dataloader()


def test_a_checkpoint_loaded_for_validation_does_not_leak_into_a_later_fit(tmp_path):
    """``validate(ckpt_path=...)`` reads the checkpoint's compression state; the next ``fit`` on the
    same Trainer must start fresh, as a fit on a new Trainer does. One rank, run in-process by the
    Trainer (as under torchrun), inside a forked process that keeps Lightning's environment to itself."""
    ((state_saved, same_as_fresh),) = run_ranks(_validate_then_fit, 1, str(tmp_path / "ckpt"))
    assert state_saved  # there was error-feedback state that could leak
    assert same_as_fresh


def _validate_then_fit(rank, world_size, checkpoints):
    def strategy():
        return GCFusedStrategy(compressor="topk", memory="residual", density=0.1, fusion="single")

    _train(
        strategy(),
        devices=1,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=checkpoints, save_last=True)],
    )
    last = os.path.join(checkpoints, "last.ckpt")
    residual = torch.load(os.path.join(f"{checkpoints}.gc_state", "last.ckpt", "rank0.pt"))["memory"]["residual"]
    fresh = _train(strategy(), seed=1, devices=1)
    pl.seed_everything(1, verbose=False)
    module = ValidatedModule()
    trainer = pl.Trainer(
        strategy=strategy(),
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.validate(ValidatedModule(), ckpt_path=last, verbose=False)
    trainer.fit(module)
    return any(t.abs().sum() > 0 for t in residual.values()), torch.equal(flat_params(module), flat_params(fresh))


def test_bf16_mixed_precision_trains():
    # (on the CPU Lightning runs "16-mixed" as bf16-mixed; the fp16 + GradScaler path is tests/kernels/test_cuda.py)
    before = flat_params(ParityModule())
    module = _train(GCFusedStrategy(compressor="fp16", memory="residual", start_method="fork"), precision="bf16-mixed")
    after = flat_params(module)
    assert torch.isfinite(after).all() and not torch.equal(after, before)


@pytest.mark.parametrize(
    "options",
    [
        dict(compressor="bf16", memory="residual"),
        dict(compressor="powersgd", rank=1, start_iter=1),
        dict(compressor="acpsgd", rank=1, start_iter=1),
    ],
    ids=["bf16+residual", "powersgd", "acpsgd"],
)
def test_checkpoint_resume_continues_identically(tmp_path, options):
    def strategy():
        return GCFusedStrategy(fusion="groups:2", start_method="fork", **options)

    straight = _train(strategy(), max_epochs=2)
    checkpoints = tmp_path / "ckpt"
    _train(
        strategy(),
        max_epochs=1,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=checkpoints, save_last=True)],
    )
    last = checkpoints / "last.ckpt"
    assert torch.load(last, weights_only=False)["gc_strategy"] == {"format": "per_rank_files", "world_size": 2}
    ranks = [torch.load(tmp_path / "ckpt.gc_state" / "last.ckpt" / f"rank{r}.pt") for r in range(2)]
    states = [r["memory"] if "residual" in r["memory"] else r["compressor"] for r in ranks]
    per_rank = [next(iter(state.values())) for state in states]  # residual / error per parameter
    assert any(not torch.equal(per_rank[0][k], per_rank[1][k]) for k in per_rank[0])  # each rank wrote its own

    # the same global seed: Lightning's DistributedSampler shuffles with it
    pl.seed_everything(0, verbose=False)
    resumed = ParityModule()
    fit(resumed, strategy(), max_epochs=2, ckpt_path=str(last))
    assert (flat_params(resumed) - flat_params(straight)).abs().max() <= 1e-6

    # the control: the same resume without the compression state does not match
    stripped = tmp_path / "stripped.ckpt"
    checkpoint = torch.load(last, weights_only=False)
    del checkpoint["gc_strategy"]
    torch.save(checkpoint, stripped)
    pl.seed_everything(0, verbose=False)
    no_state = ParityModule()
    fit(no_state, strategy(), max_epochs=2, ckpt_path=str(stripped))
    assert (flat_params(no_state) - flat_params(straight)).abs().max() > 1e-6

    # a checkpoint that holds every rank's state gathered (the earlier format) resumes the same way
    gathered = tmp_path / "gathered.ckpt"
    torch.save({**checkpoint, "gc_strategy": {"world_size": 2, "ranks": ranks}}, gathered)
    pl.seed_everything(0, verbose=False)
    from_gathered = ParityModule()
    fit(from_gathered, strategy(), max_epochs=2, ckpt_path=str(gathered))
    assert (flat_params(from_gathered) - flat_params(straight)).abs().max() <= 1e-6


def test_removed_checkpoints_take_their_rank_states_along(tmp_path):
    checkpoints = tmp_path / "ckpt"
    _train(
        GCFusedStrategy(compressor="topk", memory="residual", density=0.1, start_method="fork"),
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=1, save_top_k=1)],
    )
    (latest,) = [p.name for p in checkpoints.iterdir()]  # the latest step's only, and nothing beside it
    assert [p.name for p in (tmp_path / "ckpt.gc_state").iterdir()] == [latest]
    assert sorted(p.name for p in (tmp_path / "ckpt.gc_state" / latest).iterdir()) == ["rank0.pt", "rank1.pt"]


class SaveCountingModule(ParityModule):
    """Counts this rank's ``torch.save`` calls during fit into ``<folder>/saves<rank>``."""

    def __init__(self, folder):
        super().__init__()
        self.folder = folder

    def on_fit_start(self):
        self.saves, save = 0, torch.save

        def counted(*args, **kwargs):
            self.saves += 1
            return save(*args, **kwargs)

        torch.save = counted  # in this rank's forked process only

    def on_fit_end(self):
        with open(os.path.join(self.folder, f"saves{self.global_rank}"), "w") as f:
            f.write(str(self.saves))


def _checkpointed(folder, strategy):
    """Fit with a checkpoint every 2 steps and last.ckpt; the files it wrote, and each rank's
    ``torch.save`` calls."""
    pl.seed_everything(0, verbose=False)
    checkpoints = folder / "ckpt"
    fit(
        SaveCountingModule(str(folder)),
        strategy,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=2, save_top_k=-1, save_last=True)],
    )
    saves = [int((folder / f"saves{rank}").read_text()) for rank in range(2)]
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if not p.name.startswith("saves")), saves


def test_with_no_state_per_rank_a_checkpoint_folder_holds_what_ddp_writes(tmp_path):
    """compressor="none": the files ``ddp`` writes and nothing beside them, ``torch.save`` on rank 0
    as often as ``ddp`` and never on rank 1; the checkpoint holds the shared state and resumes."""
    (tmp_path / "ddp").mkdir()
    (tmp_path / "gc").mkdir()
    ddp_files, ddp_saves = _checkpointed(tmp_path / "ddp", "ddp_fork")
    files, saves = _checkpointed(tmp_path / "gc", "gc_fused_fork")
    assert files == ddp_files and "ckpt/last.ckpt" in files, (files, ddp_files)
    assert saves == ddp_saves and saves[0] > 0 and saves[1] == 0, (saves, ddp_saves)
    last = tmp_path / "gc" / "ckpt" / "last.ckpt"
    saved = torch.load(last, weights_only=False)["gc_strategy"]
    assert saved["format"] == "shared" and saved["state"]["step"] == 4 and saved["state"]["ready_order"]
    pl.seed_everything(0, verbose=False)
    fit(ParityModule(), GCFusedStrategy(start_method="fork"), max_epochs=2, ckpt_path=str(last))


def test_a_checkpoint_loads_into_a_module_attached_to_no_trainer(tmp_path):
    """As Lightning's test pipelines load a trained model: the strategy connected to a new module
    that no Trainer holds reads the checkpoint, its weights and its compression state."""
    ((trained, path),) = run_ranks(_train_and_save, 1, str(tmp_path / "ckpt"))
    module = ParityModule()
    strategy = GCFusedStrategy(compressor="topk", memory="residual", density=0.1)
    strategy.connect(module)
    with pytest.raises(RuntimeError, match="not attached to a `Trainer`"):
        module.trainer  # noqa: B018 (what the strategy must not read)
    checkpoint = strategy.load_checkpoint(path)
    module.load_state_dict(checkpoint["state_dict"])
    assert torch.equal(flat_params(module), trained)
    assert checkpoint["gc_strategy"]["format"] == "per_rank_files"


def _train_and_save(rank, world_size, checkpoints):
    strategy = GCFusedStrategy(compressor="topk", memory="residual", density=0.1)
    module = _train(strategy, devices=1, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=checkpoints)])
    (path,) = [str(p) for p in Path(checkpoints).glob("*.ckpt")]
    return flat_params(module), path


def test_a_linked_last_checkpoint_resumes_with_its_target_s_rank_states(tmp_path):
    def strategy():
        return GCFusedStrategy(compressor="topk", memory="residual", density=0.1, start_method="fork")

    straight = _train(strategy(), max_epochs=2)
    checkpoints = tmp_path / "ckpt"
    _train(strategy(), enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=checkpoints, save_last="link")])
    assert (checkpoints / "last.ckpt").is_symlink()
    pl.seed_everything(0, verbose=False)
    resumed = ParityModule()
    fit(resumed, strategy(), max_epochs=2, ckpt_path=str(checkpoints / "last.ckpt"))
    assert (flat_params(resumed) - flat_params(straight)).abs().max() <= 1e-6


def test_telemetry_reaches_the_logger(tmp_path):
    logger = CSVLogger(tmp_path, name="run", version=0)
    _train(
        GCFusedStrategy(compressor="fp16", fusion="groups:2", start_method="fork", log_every_n_steps=1), logger=logger
    )
    text = (tmp_path / "run" / "version_0" / "metrics.csv").read_text()
    header = text.splitlines()[0].split(",")
    for key in [
        "gc/raw_bytes",
        "gc/sent_bytes",
        "gc/compression_ratio",
        "gc/encode_s",
        "gc/decode_s",
        "gc/collective_s",
        "gc/exposed_wait_s",
        "gc/buckets",
    ]:
        assert key in header
    rows = [dict(zip(header, line.split(","))) for line in text.splitlines()[1:]]
    assert float(rows[-1]["gc/compression_ratio"]) == 2.0


def test_spawn_launcher():
    module = _train(GCFusedStrategy(fusion="groups:2", start_method="spawn"))
    reference = _train("ddp_fork")
    assert (flat_params(module) - flat_params(reference)).abs().max() <= 1e-6


SCRIPT = textwrap.dedent(
    """
    import atexit
    import os
    import sys
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    sys.path.insert(0, {tests!r})
    import gc_strategy  # registers "gc_fused"
    from models import ParityModule, fit, flat_params

    # atexit runs last-in first-out: this runs after every handler that training registers
    rank = os.environ.get("LOCAL_RANK", "0")
    # one write per rank: the ranks share the pipe, and an unbuffered print writes piece by piece
    atexit.register(lambda: os.write(1, f"RANK {{rank}} GROUP LEFT AT EXIT {{dist.is_initialized()}}\\n".encode()))
    pl.seed_everything(0, verbose=False)
    module = ParityModule()
    trainer = fit(module, "gc_fused")
    if trainer.global_rank == 0:
        print("CHECKSUM", float(flat_params(module).double().sum()))
    """
)


def test_popen_launcher_from_a_script(tmp_path):
    script = tmp_path / "train_script.py"
    script.write_text(SCRIPT.format(tests=str(TESTS)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # a gloo group left to the interpreter's shutdown can abort a rank after training succeeded
    assert sorted(re.findall(r"RANK \d GROUP LEFT AT EXIT \w+", done.stdout)) == [
        "RANK 0 GROUP LEFT AT EXIT False",
        "RANK 1 GROUP LEFT AT EXIT False",
    ]
    checksum = float(done.stdout.split("CHECKSUM")[1].split()[0])
    reference = flat_params(_train("ddp_fork")).double().sum()
    assert abs(checksum - float(reference)) < 1e-6 * max(1.0, abs(float(reference)))


def test_hierarchy_is_validated_at_construction():
    with pytest.raises(ValueError, match="hierarchy = 'rack' is invalid; allowed: 'flat', 'node'"):
        GCFusedStrategy(hierarchy="rack")
    assert GCFusedStrategy(hierarchy="node").hierarchy == NodeHierarchy()
    assert GCFusedStrategy(hierarchy="flat").hierarchy is None
