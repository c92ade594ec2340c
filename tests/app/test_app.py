"""The Hydra app: config composition, the recipes' real loaders on tiny generated files, the CLI."""

import csv
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from locations import ROOT

from gc_strategy import COMPRESSORS, MEMORIES, EveryStep, GCFSDPStrategy, NodeHierarchy

CONF = ROOT / "conf"
sys.path.insert(0, str(ROOT))

from recipes.bert import BertMaskedLM, MaskedTextDataModule  # noqa: E402
from recipes.images import ImageDataModule, MissingDataset  # noqa: E402
from recipes.lstm import LSTMLanguageModel  # noqa: E402
from recipes.resnet import ResNetClassifier  # noqa: E402
from recipes.text import LanguageModelDataModule  # noqa: E402
from train import ROLE_GROUPS, build_strategy, check_app, fusion_spec  # noqa: E402


def _compose(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def _members(group):
    """The group's members as Hydra sees them (files in conf/, configs in the ConfigStore)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return sorted(GlobalHydra.instance().config_loader().get_group_options(group))


def test_defaults():
    cfg = _compose()
    assert (cfg.compressor.name, cfg.memory.name, cfg.communicator.name, fusion_spec(cfg.fusion)) == (
        "none",
        "none",
        "auto",
        "bucket_mb:25",
    )
    assert (cfg.model.recipe, cfg.data.name, cfg.trainer.accelerator, cfg.trainer.devices, cfg.logger.mode) == (
        "resnet",
        "synthetic",
        "cpu",
        2,
        "offline",
    )


@pytest.mark.parametrize(
    "group", ["compressor", "memory", "communicator", "fusion", "sync", "model", "data", "trainer", "logger"]
)
def test_every_group_member_composes(group):
    for member in _members(group):
        cfg = _compose(f"{group}={member}")
        assert cfg[group] is not None


def test_the_role_groups_are_the_registries_with_their_declared_defaults():
    """Every registered compressor, memory and communicator is a group member (made from the
    registry, no file to keep in step), each option settable with its declared default."""
    assert not [p for group in ROLE_GROUPS for p in (CONF / group).glob("*.yaml")]
    assert _members("communicator") == ["allgather", "allreduce", "auto"]
    for group, registry in (("compressor", COMPRESSORS), ("memory", MEMORIES)):
        assert _members(group) == registry.names()
        for name in registry.names():
            cfg = _compose(f"{group}={name}")
            options = {k: v for k, v in cfg[group].items() if k != "name"}
            declared = registry.options(name)
            assert set(options) == set(declared), name
            assert all(options[k] == declared[k].default for k in options), name
            build_strategy(_compose(f"{group}={name}"))  # the composed config builds


def test_fusion_spec_and_strategy_from_config():
    cfg = _compose("compressor=topk", "compressor.density=0.05", "memory=residual", "fusion=groups", "fusion.n=8")
    strategy = build_strategy(cfg)
    assert strategy.components.describe() == "compressor=topk memory=residual communicator=allgather fusion=groups:8"
    assert strategy.components.compressor.options["density"] == 0.05
    assert strategy.hierarchy is None
    assert build_strategy(_compose("trainer.hierarchy=node")).hierarchy == NodeHierarchy()
    node_bf16 = build_strategy(_compose("trainer.hierarchy=node", "trainer.node_precision=bf16"))
    assert node_bf16.hierarchy == NodeHierarchy(precision="bf16")


def test_sharding_from_config():
    """``trainer.sharding=fsdp`` builds gc_fsdp; what applies to replicated training only is refused
    by the app's checks (the library's, naming the app's keys)."""
    strategy = build_strategy(_compose("trainer.sharding=fsdp", "compressor=topk", "memory=residual"))
    assert isinstance(strategy, GCFSDPStrategy) and strategy.components.compressor.name == "topk"
    for overrides, message in (
        (
            ["trainer.sharding=fsdp", "fusion=groups", "fusion.n=4"],
            "fusion = 'groups:4' is invalid with trainer",
        ),
        (["trainer.sharding=fsdp", "trainer.hierarchy=node"], "trainer.hierarchy = 'node' is invalid with trainer.sh"),
        (
            ["trainer.sharding=fsdp", "trainer.find_unused_parameters=true"],
            "(each reduction holds the parameters that got a gradient, whatever the option)",
        ),
        (["trainer.sharding=ddp"], "trainer.sharding = 'ddp' is invalid; allowed: none, fsdp"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            check_app(_compose(*overrides))


@pytest.mark.slow
def test_cli_trains_bert_sharded_inside_the_node(tmp_path):
    """BERT (tied word embeddings and decoder) through gc_fsdp with top-k: the recipe's units (each
    encoder layer, then the model with the tied parameter) print no FSDP2 warning of a unit that
    returns a view, and the sharded checkpoint has each rank's state."""
    run = tmp_path / "run"
    done = _cli(
        tmp_path,
        "model=bert",
        "data=synthetic_tokens",
        "data.train_tokens=20000",
        "data.val_tokens=4000",
        "trainer.sharding=fsdp",
        "compressor=topk",
        "compressor.density=0.01",
        "memory=residual",
        "logger=csv",
        *QUICK[:3],
        "speedup.warmup_steps=0",
        f"hydra.run.dir={run}",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "returned a view tensor" not in done.stdout + done.stderr
    assert (run / "checkpoints" / "last.ckpt").is_dir()  # torch.distributed.checkpoint's folder
    assert sorted(p.name for p in (run / "checkpoints.gc_state" / "last.ckpt").iterdir()) == ["rank0.pt", "rank1.pt"]


def test_sync_diloco_from_config():
    assert build_strategy(_compose()).sync == EveryStep()
    cfg = _compose("compressor=topk", "memory=residual", "sync=diloco", "sync.inner_steps=20", "sync.fragments=4")
    sync = build_strategy(cfg).sync
    assert (sync.inner_steps, sync.fragments, sync.vectors, sync.outer_lr) == (20, 4, "bf16", 1.0)
    with pytest.raises(ValueError, match="'overlap_steps' = 20 is invalid with inner_steps = 20"):
        build_strategy(_compose("sync=diloco", "sync.inner_steps=20", "sync.overlap_steps=20"))


# ---------------------------------------------------------------- real loaders on tiny files
def _write_cifar(folder: Path, per_batch: int = 8):
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {
            "data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            "labels": list(rng.integers(0, 10, per_batch)),
        }
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)


def _one_step(module, loader):
    x, y = next(iter(loader))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    loss = module.training_step((x, y), 0) if not hasattr(module, "_loss") else module._loss((x, y))
    loss.backward()
    optimizer.step()
    return loss


def test_cifar10_loader_reads_python_batches(tmp_path, monkeypatch):
    _write_cifar(tmp_path / "cifar-10-batches-py")
    data = ImageDataModule("cifar10", data_dir=str(tmp_path), batch_size=4)
    data.setup("fit")
    assert len(data.train_set) == 40 and len(data.val_set) == 8
    x, y = next(iter(data.train_dataloader()))
    assert x.shape == (4, 3, 32, 32) and y.dtype == torch.int64
    module = ResNetClassifier(cifar_stem=True)
    monkeypatch.setattr(module, "log", lambda *a, **k: None)
    assert torch.isfinite(_one_step(module, data.train_dataloader()))


def test_imagenet_loader_reads_class_folders(tmp_path, monkeypatch):
    from PIL import Image

    for split in ("train", "val"):
        for label in ("n01", "n02"):
            folder = tmp_path / split / label
            folder.mkdir(parents=True)
            for i in range(2):
                Image.fromarray(np.full((40, 48, 3), 40 * i, dtype=np.uint8)).save(folder / f"{i}.JPEG")
    data = ImageDataModule("imagenet", data_dir=str(tmp_path), batch_size=2, image_size=32, num_classes=2)
    data.setup("fit")
    assert data.train_set.classes == ["n01", "n02"]
    module = ResNetClassifier(num_classes=2, cifar_stem=False)
    monkeypatch.setattr(module, "log", lambda *a, **k: None)
    assert torch.isfinite(_one_step(module, data.train_dataloader()))


def test_wikitext2_loader_reads_token_files(tmp_path, monkeypatch):
    text = " = Heading = \n the cat sat on the mat @-@ again . \n <unk> dogs run . \n"
    for split in ("train", "valid", "test"):
        (tmp_path / f"wiki.{split}.tokens").write_text(text * 20)
    data = LanguageModelDataModule("wikitext2", data_dir=str(tmp_path), batch_size=2, bptt=5)
    data.setup("fit")
    assert data.vocabulary.index["<eos>"] == 1 and "@-@" in data.vocabulary.index
    tokens, targets = data.train_set[0]
    assert torch.equal(tokens[1:], targets[:-1])
    module = LSTMLanguageModel(vocab_size=data.vocab_size, embedding_dim=16, hidden_dim=16, tied=True)
    monkeypatch.setattr(module, "log", lambda *a, **k: None)
    assert torch.isfinite(_one_step(module, data.train_dataloader()))


CORPUS = [
    "The quick brown fox jumps over the lazy dog near the riverbank.",
    "Gradient compression reduces the traffic of data-parallel training.",
    "Error feedback keeps what compression dropped and adds it back later.",
    "Buckets fuse many small tensors into one message on the network.",
]


def test_bert_loader_trains_wordpiece_on_text_files_and_masks_15_percent(tmp_path, monkeypatch):
    for split, repeat in (("train", 60), ("valid", 10)):
        (tmp_path / f"{split}.txt").write_text("\n".join(CORPUS * repeat) + "\n")
    data = MaskedTextDataModule("corpus", data_dir=str(tmp_path), vocab_size=200, max_length=16, batch_size=4)
    data.setup("fit")
    tokenizer = data.tokenizer
    assert tokenizer.tokenize("compression")[0] != "[UNK]"  # learnt from the file
    block = data.train_set[0]["input_ids"]
    assert block[0] == tokenizer.cls_token_id and block[-1] == tokenizer.sep_token_id and len(block) == 16
    torch.manual_seed(0)
    masked, ordinary = 0, 0
    while ordinary < 10_000:  # [CLS] and [SEP] are never masked: 15% of the other 14 of 16 tokens
        for batch in data.train_dataloader():
            masked += int((batch["labels"] != -100).sum())
            ordinary += batch["input_ids"].numel() * 14 // 16
    assert abs(masked / ordinary - 0.15) < 0.015  # the standard error is about 0.0036
    module = BertMaskedLM(vocab_size=data.vocab_size, max_length=data.max_length)
    monkeypatch.setattr(module, "log", lambda *a, **k: None)
    batch = next(iter(data.train_dataloader()))
    loss = module.training_step(batch, 0)
    loss.backward()
    assert torch.isfinite(loss) and module.bert.bert.embeddings.word_embeddings.weight.grad is not None
    tokenizer_file = tmp_path / "tokenizer.json"
    tokenizer.backend_tokenizer.save(str(tokenizer_file))
    again = MaskedTextDataModule("corpus", data_dir=str(tmp_path), tokenizer_path=str(tokenizer_file), max_length=16)
    again.setup("fit")
    assert torch.equal(again.train_set.blocks, data.train_set.blocks)


def test_bert_synthetic_tokens_and_sizes():
    data = MaskedTextDataModule(
        "synthetic", vocab_size=50, max_length=8, batch_size=2, train_tokens=600, val_tokens=120
    )
    data.setup("fit")
    assert data.vocab_size == 55 and len(data.train_set) == 100
    assert BertMaskedLM(vocab_size=55, max_length=8).bert.config.hidden_size == 128
    with pytest.raises(ValueError, match="model.size = 'huge' is invalid; allowed: tiny, base, large"):
        BertMaskedLM(vocab_size=55, max_length=8, size="huge")


def test_missing_datasets_name_the_path_and_the_synthetic_option(tmp_path):
    with pytest.raises(MissingDataset, match="cifar-10-batches-py.*data=synthetic_images"):
        ImageDataModule("cifar10", data_dir=str(tmp_path)).setup("fit")
    with pytest.raises(MissingDataset, match="wiki.train.tokens.*data=synthetic_text"):
        LanguageModelDataModule("wikitext2", data_dir=str(tmp_path)).setup("fit")
    with pytest.raises(MissingDataset, match="train.txt.*data=synthetic_tokens"):
        MaskedTextDataModule("corpus", data_dir=str(tmp_path)).setup("fit")


# ---------------------------------------------------------------- the command line
QUICK = [
    "trainer.max_steps=4",
    "trainer.val_check_interval=2",
    "trainer.checkpoint_every_n_steps=2",
    "data.train_samples=256",
    "data.val_samples=64",
    "speedup.warmup_steps=0",
]


def _cli(tmp_path, *args, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_cli_run_logs_the_speedup_summary_and_saves_a_checkpoint(tmp_path):
    done = _cli(
        tmp_path,
        *QUICK,
        "trainer.max_steps=12",
        "compressor=fp16",
        "fusion=auto",
        "fusion.profile_steps=1",
        "speedup.baseline_steps=2",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["compression_ratio"] == 2.0 and summary["speedup_vs_fp32_allreduce_measured"] > 0
    assert summary["auto_plan_buckets"] >= 1 and summary["speedup_vs_fp32_allreduce_estimated_by_timeline_model"] > 0
    assert "fusion=auto plan:" in done.stdout
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["last.ckpt"]  # checkpoints=last, the default
    wandb_runs = list((run / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 1
    # an offline run keeps its history and summary in the run's .wandb file, tables under media/
    record = next(wandb_runs[0].glob("run-*.wandb")).read_bytes()
    assert b"speedup_vs_fp32_allreduce_measured" in record and b"compression_ratio" in record
    tables = sorted(p.name for p in (wandb_runs[0] / "files" / "media" / "table" / "gc").glob("*.table.json"))
    assert [t.split("_")[0] for t in tables] == ["bucket", "step"]
    assert "W&B run:" in done.stdout and "checkpoints:" in done.stdout
    # the last validation's figures beside the speedup, in summary.json and the W&B run's readable summary
    readable = json.loads((wandb_runs[0] / "files" / "wandb-summary.json").read_text())
    for figures in (summary, readable):
        assert figures["val_step"] == 12 and 0.0 <= figures["val/acc"] <= 1.0 and figures["val/loss"] > 0
        assert figures["compression_ratio"] == 2.0
    assert not (run / "train.log").exists()  # Python's logging goes to the console alone


@pytest.mark.slow
def test_a_run_prints_steps_no_harmless_third_party_noise_and_keeps_the_checkpoints_asked(tmp_path):
    args = [a for a in QUICK if not a.startswith("speedup.warmup_steps")]  # the default 5: none of 4 timed
    done = _cli(tmp_path, *args, "checkpoints=all", f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Step (epoch 0)" in done.stdout and "4/4" in done.stdout and "Epoch 0/-2" not in done.stdout
    for noise in ("LeafSpec", "💡 Tip", "anonymous setting"):
        assert noise not in done.stdout + done.stderr, noise
    assert "no step was timed: all trainer.max_steps = 4 fell within speedup.warmup_steps = 5" in done.stdout
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert checkpoints == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]

    done = _cli(tmp_path, *QUICK, "checkpoints=none", f"hydra.run.dir={tmp_path / 'none'}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "checkpoints: none kept (checkpoints=none)" in done.stdout
    assert not (tmp_path / "none" / "checkpoints").exists()


def _final_validation_accuracy(run: Path) -> float:
    (metrics,) = run.glob("csv/*/metrics.csv")
    with metrics.open() as f:
        return float([row for row in csv.DictReader(f) if row["val/acc"]][-1]["val/acc"])


@pytest.mark.slow
def test_diloco_in_the_app_validates_like_every_step_training(tmp_path):
    """The app's default recipe (ResNet-18 with BatchNorm on synthetic images, 2 CPU ranks, 150 steps,
    validation right after each outer step) with sync=diloco at its defaults ends within 5 points of
    sync=every_step's validation accuracy, which passes 90%."""
    accuracy = {}
    for sync in ("every_step", "diloco"):
        run = tmp_path / sync
        done = _cli(tmp_path, f"sync={sync}", "logger=csv", "checkpoints=none", f"hydra.run.dir={run}", timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        accuracy[sync] = _final_validation_accuracy(run)
    assert accuracy["every_step"] > 0.9 and accuracy["diloco"] >= accuracy["every_step"] - 0.05, accuracy


def test_help_lists_the_groups_and_the_config():
    done = _cli(Path("/tmp"), "--help", timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    for group in (
        "compressor:",
        "memory:",
        "communicator:",
        "fusion:",
        "lowrank_model:",
        "model:",
        "data:",
        "trainer:",
        "logger:",
    ):
        assert group in done.stdout
    assert "auto, bucket_mb, file, groups, layerwise, single" in done.stdout


@pytest.mark.slow
def test_cli_powerfish_converts_after_the_warmup_and_checkpoints_the_low_rank_model(tmp_path):
    done = _cli(
        tmp_path,
        *QUICK,
        "logger=csv",
        "compressor=powersgd",
        "lowrank_model=powerfish",
        "lowrank_model.warmup_steps=2",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 2: full-rank warm-up over. Pufferfish: 14 layers factorised, 7 kept full-rank" in done.stderr
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    assert "net.layer2.0.conv1.u.weight" in state["state_dict"] and "net.layer1.0.conv1.weight" in state["state_dict"]
    # saved by the synchroniser of the low-rank phase, which holds no PowerSGD state yet: nothing per
    # rank, and the files of the save before the conversion went with it
    saved = state["gc_strategy"]
    assert saved["format"] == "shared" and "net.layer2.0.conv1.u.weight" in saved["state"]["ready_order"]
    assert not saved["state"]["compressor_extra"] and not (tmp_path / "run" / "checkpoints.gc_state").exists()


@pytest.mark.slow
def test_multirun_makes_one_wandb_run_per_job(tmp_path):
    done = _cli(
        tmp_path, "-m", *QUICK, "trainer.max_steps=2", "compressor=none,fp16", f"hydra.sweep.dir={tmp_path / 'sweep'}"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    runs = sorted((tmp_path / "sweep").glob("*/wandb/offline-run-*"))
    assert len(runs) == 2 and runs[0].parent.parent != runs[1].parent.parent


@pytest.mark.parametrize(
    "args, message",
    [
        (["compressor=topkk"], "Could not find 'compressor/topkk'"),
        (["compressor.densty=0.1"], "Could not override 'compressor.densty'"),
        (["compressor=topk", "+compressor.densty=0.1"], "option(s) densty are not taken by compressor=topk"),
        (["compressor=topk", "compressor.density=2"], "option 'density' = 2 is invalid; allowed: a number in (0, 1]"),
        (["data=cifar10", "data.data_dir=nowhere"], "CIFAR-10 not found"),
        (
            ["model=lstm"],
            "model 'lstm' needs text data, but data.kind = 'images'; choose data=synthetic_text or data=wik",
        ),
        (
            ["compressor=topk", "+rank=4"],
            "rank is not an option of train.py (+rank=4 adds a key no one reads); rank is an option of compressor "
            "acpsgd, powersgd: compressor=acpsgd compressor.rank=4",
        ),
        (["compressor=powersgd", "+rank=4"], "(+rank=4 adds a key no one reads); did you mean compressor.rank=4?"),
        (["+trainer.max_step=4"], "trainer.max_step is not an option of train.py (+trainer.max_step=4 adds a key"),
        (["+trainer.max_step=4"], "did you mean trainer.max_steps=4?"),
        (
            ["sync=diloco", "sync.inner_steps=1000"],
            "sync.inner_steps = 1000 is invalid with trainer.max_steps = 4: no outer step would synchronise",
        ),
        (["fusion=file"], "fusion.path"),
        (["sync=diloco", "sync.inner_steps=0"], "option 'inner_steps' = 0 is invalid; allowed: an integer in [1, inf)"),
        (
            ["sync=diloco", "sync.inner_steps=4", "speedup.baseline_steps=6", "trainer.max_steps=20"],
            "switch_components (a baseline phase, a Pufferfish conversion) is not supported with sync=DiLoCo",
        ),
        (["checkpoints=some"], "checkpoints = 'some' is invalid; allowed: last, all, none"),
        (["speedup.baseline_steps=2"], "speedup.baseline_steps = 2 is invalid with speedup.warmup_steps = 5"),
        (
            ["speedup.warmup_steps=1", "speedup.baseline_steps=3"],
            "speedup.baseline_steps = 3 is invalid with trainer.max_steps = 4: the baseline steps count within",
        ),
        (["fusion=file", "fusion.path=/nonexistent/plan.json"], "not a readable plan file"),
        (
            ["lowrank_model=pufferfish", "lowrank_model.ratio=1.5"],
            "option 'ratio' = 1.5 is invalid; allowed: a number in (0, 1]",
        ),
        (
            ["lowrank_model=pufferfish", "lowrank_model.warmup_steps=-3"],
            "lowrank_model options (lowrank_model.<name>=...): PufferfishWarmup: option 'warmup_steps' = -3 is invalid",
        ),
        (
            ["lowrank_model=pufferfish", "lowrank_model.keep_full_rank=[net.layer9.*]"],
            "pattern 'net.layer9.*' matches no factorisable",
        ),
    ],
)
def test_bad_input_fails_clearly_before_training(tmp_path, args, message):
    """The message names the option, the value and what is allowed; the refused run leaves no folder."""
    done = _cli(tmp_path, "trainer.max_steps=4", *args, f"hydra.run.dir={tmp_path / 'run'}", timeout=120)
    assert done.returncode != 0
    assert message in done.stderr
    assert not (tmp_path / "run").exists()


def test_no_step_to_train_is_refused(tmp_path):
    done = _cli(tmp_path, "trainer.max_steps=0", f"hydra.run.dir={tmp_path / 'run'}", timeout=120)
    assert done.returncode == 2
    assert "trainer.max_steps = 0 is invalid; allowed: an integer >= 1" in done.stderr
    assert "checkpoints:" not in done.stdout and not (tmp_path / "run").exists()


def test_summary_bytes_and_breakdown_cover_the_timed_steps_only(tmp_path):
    """PowerSGD-like: the first steps (start_iter) send everything, the timed ones a little."""
    summary = _monitored(tmp_path, [1000, 1000, 10, 10, 10])
    assert len(summary["step_times_s"]) == 3
    assert summary["sent_bytes_per_step"] == 10 and summary["compression_ratio"] == 100
    assert summary["breakdown"]["encode+decode"] == pytest.approx(0.03)
    assert summary["breakdown"]["exposed communication"] == pytest.approx(0.001)


def test_summary_bytes_per_step_with_an_exchange_every_few_steps(tmp_path):
    """sync="diloco"-like: an exchange after every second step; its bytes spread over the timed
    steps, and no per-step breakdown (there is no exchange in most steps)."""
    summary = _monitored(tmp_path, [None, 1000, None, 10, None, 10])
    assert len(summary["step_times_s"]) == 4
    assert summary["sent_bytes_per_step"] == 20 / 4 and summary["compression_ratio"] == 100
    assert "breakdown" not in summary


def _monitored(tmp_path, sent_per_step):
    """ThroughputMonitor over fake steps; ``None``: no exchange in that step."""
    from types import SimpleNamespace

    from gc_strategy import StepTelemetry
    from gc_strategy.integrations.monitor import ThroughputMonitor
    from gc_strategy.telemetry import TelemetryLog

    monitor = ThroughputMonitor(batch_size=4, output_dir=str(tmp_path), warmup_steps=2)
    synchronizer = SimpleNamespace(telemetry=TelemetryLog())
    trainer = SimpleNamespace(
        global_step=0,
        world_size=2,
        strategy=SimpleNamespace(synchronizer=synchronizer),
        is_global_zero=True,
        loggers=[],
    )
    module = SimpleNamespace(log_dict=lambda *a, **k: None)
    for step, sent in enumerate(sent_per_step):
        monitor.on_train_batch_start(trainer, module, None, step)
        if sent is not None:
            synchronizer.telemetry.record(
                StepTelemetry(raw_bytes=1000, sent_bytes=sent, encode_s=0.01 * step, exposed_wait_s=0.001)
            )
        trainer.global_step = step + 1
        monitor.on_train_batch_end(trainer, module, None, None, step)
    monitor.on_train_end(trainer, module)
    return monitor.summary
