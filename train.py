"""Train a recipe with compressed gradient synchronisation: ``python train.py compressor=dgc fusion=auto``.

A Hydra app over ``conf/``: groups compressor/ memory/ communicator/ fusion/ sync/ model/ data/ trainer/ logger/;
``fault_tolerance.*`` makes each process a replica group that survives the others' loss
(``fault_tolerance.lighthouse=local``: a lighthouse and the groups on this machine, docs/fault_tolerance.md).
Every option of a compressor or memory is a key of its group (``compressor.density=0.001``) and is
validated before any work starts. Outputs (W&B offline run, checkpoints, ``summary.json``) go to
Hydra's run directory, a new one per run.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import hydra
import lightning.pytorch as pl
import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from app.console import StepProgressBar, quiet_harmless_messages
from app.replica_groups import KillAt, ParameterDigest, StepRecord, group_devices, run_replica_groups
from gc_strategy import (
    COMMUNICATORS,
    COMPRESSORS,
    MEMORIES,
    FaultTolerance,
    FinishTogether,
    GCFSDPStrategy,
    GCFusedStrategy,
    build_components,
)
from gc_strategy.integrations.monitor import ThroughputMonitor
from gc_strategy.pufferfish import PufferfishWarmup, enable_factorized_loading, select_layers
from gc_strategy.registry import closest
from gc_strategy.sync.fault_tolerance.lighthouse import LighthouseUnreachable, reach_lighthouse
from gc_strategy.sync.modes import Replicated, Sharded, check_setup, parse_sync, sync_of
from gc_strategy.sync.paths.hierarchy import hierarchy_of
from recipes.bert import BertMaskedLM, MaskedTextDataModule
from recipes.corpus import CorpusDataModule
from recipes.gpt import GPTLanguageModel
from recipes.images import ImageDataModule, MissingDataset
from recipes.lstm import LSTMLanguageModel
from recipes.resnet import ResNetClassifier
from recipes.text import LanguageModelDataModule

RECIPES = {"resnet": "images", "lstm": "text", "bert": "mlm", "gpt": "corpus"}
#: the data option that is one sample's tokens, by data kind (language models' throughput in tokens too)
SEQUENCE_LENGTH = {"text": "bptt", "mlm": "max_length", "corpus": "context"}
CHECKPOINTS = ("last", "all", "none")
#: the Hydra groups made from the registries: one member per registered name
ROLE_GROUPS = {"compressor": COMPRESSORS, "memory": MEMORIES, "communicator": COMMUNICATORS}


def store_role_configs(store: ConfigStore) -> None:
    """The groups ``compressor``, ``memory`` and ``communicator``: one member per registered role,
    holding its name and its declared options at their defaults. The registries' ``Option``s are the
    one source of truth; :func:`build_strategy` validates what the command line sets."""
    for group, registry in ROLE_GROUPS.items():
        for name in registry.names():
            defaults = {key: option.default for key, option in registry.options(name).items()}
            store.store(group=group, name=name, node={"name": name, **defaults})
    store.store(group="communicator", name="auto", node={"name": "auto"})


store_role_configs(ConfigStore.instance())


def _options(group: DictConfig) -> dict:
    missing = [f"{group._key()}.{k}" for k in group if OmegaConf.is_missing(group, k)]
    if missing:
        raise ValueError(f"{group._key()}={group.name} needs a value for {', '.join(missing)} (add {missing[0]}=...)")
    return {k: v for k, v in OmegaConf.to_container(group, resolve=True).items() if k != "name"}


def fusion_spec(fusion: DictConfig) -> str:
    """``fusion=groups fusion.n=8`` -> ``"groups:8"`` (the strategy's string form)."""
    options = _options(fusion)
    if len(options) > 1:
        raise ValueError(f"fusion '{fusion.name}' takes at most one parameter, got {sorted(options)}")
    return f"{fusion.name}:{next(iter(options.values()))}" if options else fusion.name


#: ``trainer.sharding``: every rank holds the whole model (``gc_fused``), or FSDP2 shards it inside
#: each node (``gc_fsdp``, docs/sharded.md)
SHARDINGS = ("none", "fsdp")


#: the app's names of the options that the library's checks before any work refuse (check_setup)
APP_NAMES = {
    "fusion": "fusion",
    "hierarchy": "trainer.hierarchy",
    "find_unused_parameters": "trainer.find_unused_parameters",
    "broadcast_buffers": "trainer.broadcast_buffers",
    "fault_tolerance": "fault_tolerance.lighthouse",
    "sharding": "trainer.sharding=fsdp",
    "nodes": "trainer.num_nodes",
    "ranks": "trainer.devices",
}


def roles_options(cfg: DictConfig) -> dict:
    return {**_options(cfg.compressor), **_options(cfg.memory), **_options(cfg.communicator)}


def check_sharding(cfg: DictConfig) -> str:
    sharding = cfg.trainer.sharding
    if sharding not in SHARDINGS:
        raise ValueError(f"trainer.sharding = {sharding!r} is invalid; allowed: {', '.join(SHARDINGS)}")
    return sharding


def check_app_setup(cfg: DictConfig) -> None:
    """The library's checks before any work (:func:`~gc_strategy.sync.modes.check_setup`), on the
    app's configuration and naming its keys: the roles, the sync mode, the placement, roles switched
    during the run (a baseline phase, a Pufferfish model) and, with fault tolerance, the replica
    group that ``trainer.devices`` ranks on ``trainer.num_nodes`` machines form."""
    t = cfg.trainer
    components = build_components(
        cfg.compressor.name, cfg.memory.name, cfg.communicator.name, fusion_spec(cfg.fusion), **roles_options(cfg)
    )
    mode = parse_sync(sync_of(cfg.sync.name, _options(cfg.sync)), components)
    fault_tolerance = fault_tolerance_of(cfg)
    replicated = None
    if check_sharding(cfg) == "fsdp":
        placement: Replicated | Sharded = Sharded(fault_tolerance=fault_tolerance)
        replicated = {
            "fusion": fusion_spec(cfg.fusion),
            "hierarchy": t.hierarchy,
            "find_unused_parameters": t.find_unused_parameters,
        }
    else:
        hierarchy = hierarchy_of(t.hierarchy, t.node_precision) or "flat"
        placement = Replicated(hierarchy=hierarchy, fault_tolerance=fault_tolerance)
    switches = bool(cfg.speedup.baseline_steps or cfg.lowrank_model.enabled)
    check_setup(mode, components, placement, t.devices, t.num_nodes, switches, replicated, APP_NAMES)


def build_strategy(cfg: DictConfig) -> GCFusedStrategy | GCFSDPStrategy:
    options = roles_options(cfg)
    if check_sharding(cfg) == "fsdp":
        return build_sharded_strategy(cfg, options)
    return GCFusedStrategy(
        compressor=cfg.compressor.name,
        memory=cfg.memory.name,
        communicator=cfg.communicator.name,
        fusion=fusion_spec(cfg.fusion),
        start_method=cfg.trainer.start_method,
        log_every_n_steps=cfg.trainer.log_every_n_steps,
        find_unused_parameters=cfg.trainer.find_unused_parameters,
        hierarchy=hierarchy_of(cfg.trainer.hierarchy, cfg.trainer.node_precision) or "flat",
        broadcast_buffers=cfg.trainer.broadcast_buffers,
        sync=sync_of(cfg.sync.name, _options(cfg.sync)),
        fault_tolerance=fault_tolerance_of(cfg),
        **options,
    )


def fault_tolerance_of(cfg: DictConfig) -> FaultTolerance | None:
    """This launch's replica group (its ``trainer.devices`` ranks on one machine) where
    ``fault_tolerance.lighthouse`` is an address; None where it is null."""
    ft = cfg.fault_tolerance
    if ft.lighthouse is None:
        return None
    keys = ("replica_group", "groups", "min_replicas", "timeout_s", "quorum_timeout_s", "silence_s")
    options = {k: ft[k] for k in keys}
    # ``local``: each group gets the address of the lighthouse the app starts; checked with a stand-in
    lighthouse = "http://127.0.0.1:0" if ft.lighthouse == "local" else ft.lighthouse
    try:
        return FaultTolerance(lighthouse=lighthouse, **options)
    except ValueError as error:  # name the group the user sets them in
        raise ValueError(f"fault_tolerance options (fault_tolerance.<name>=...): {error}") from error


def check_demo(cfg: DictConfig) -> None:
    """``fault_tolerance.kill_group`` and ``kill_at`` (the demo): both or neither, within the run."""
    ft = cfg.fault_tolerance
    if (ft.kill_group is None) != (ft.kill_at is None):
        raise ValueError("fault_tolerance.kill_group and fault_tolerance.kill_at go together: set both, or neither")
    if ft.kill_group is not None and not 0 <= ft.kill_group < ft.groups:
        raise ValueError(
            f"fault_tolerance.kill_group = {ft.kill_group} is invalid with fault_tolerance.groups = {ft.groups}; "
            f"allowed: 0 to {ft.groups - 1}"
        )
    if ft.kill_at is not None and not 1 <= ft.kill_at < cfg.trainer.max_steps:
        raise ValueError(
            f"fault_tolerance.kill_at = {ft.kill_at} is invalid with trainer.max_steps = {cfg.trainer.max_steps}; "
            f"allowed: 1 to {cfg.trainer.max_steps - 1}"
        )


def build_sharded_strategy(cfg: DictConfig, options: dict) -> GCFSDPStrategy:
    """``trainer.sharding=fsdp``: FSDP2 inside each node (what applies to replicated training only is
    refused by :func:`check_app_setup`)."""
    t = cfg.trainer
    return GCFSDPStrategy(
        compressor=cfg.compressor.name,
        memory=cfg.memory.name,
        communicator=cfg.communicator.name,
        sync=sync_of(cfg.sync.name, _options(cfg.sync)),
        start_method=t.start_method,
        log_every_n_steps=t.log_every_n_steps,
        fault_tolerance=fault_tolerance_of(cfg),
        **options,
    )


def build_recipe(cfg: DictConfig, seed: int) -> tuple[pl.LightningModule, pl.LightningDataModule]:
    recipe = cfg.model.recipe
    if recipe not in RECIPES:
        raise ValueError(f"model.recipe = {recipe!r} is invalid; allowed: {', '.join(RECIPES)}")
    if cfg.data.kind != RECIPES[recipe]:
        fitting = " or ".join(f"data={name}" for name in data_members(RECIPES[recipe]))
        raise ValueError(
            f"model '{recipe}' needs {RECIPES[recipe]} data, but data.kind = {cfg.data.kind!r}; choose {fitting}"
        )
    model_options = {k: v for k, v in OmegaConf.to_container(cfg.model, resolve=True).items() if k != "recipe"}
    data_options = {k: v for k, v in OmegaConf.to_container(cfg.data, resolve=True).items() if k != "kind"}
    if recipe == "resnet":
        data = ImageDataModule(seed=seed, **data_options)
        data.check_present()
        return ResNetClassifier(**model_options), data
    if recipe == "gpt":  # the vocabulary is known without reading the corpus: bytes, or the tokenizer's
        data = CorpusDataModule(seed=seed, **data_options)
        data.check_present()
        return GPTLanguageModel(vocab_size=data.vocab_size, context=data.context, **model_options), data
    if recipe == "bert":
        data = MaskedTextDataModule(seed=seed, **data_options)
        data.setup("fit")  # the tokenizer's vocabulary and the block length are the model's
        return BertMaskedLM(vocab_size=data.vocab_size, max_length=data.max_length, **model_options), data
    data = LanguageModelDataModule(seed=seed, **data_options)
    data.setup("fit")  # the vocabulary size is the model's
    return LSTMLanguageModel(vocab_size=data.vocab_size, **model_options), data


def data_members(kind: str) -> list[str]:
    """The members of the ``data`` group of this ``kind`` (``images``, ``text``, ``mlm``, ``corpus``)."""
    folder = Path(__file__).parent / "conf" / "data"
    return sorted(f.stem for f in folder.glob("*.yaml") if OmegaConf.load(f).get("kind") == kind)


def build_lowrank_model(cfg: DictConfig, module: pl.LightningModule) -> list[pl.Callback]:
    """``lowrank_model=pufferfish`` / ``lowrank_model=powerfish``: the full-rank warm-up callback, checked now."""
    options = OmegaConf.to_container(cfg.lowrank_model, resolve=True)
    if not options.pop("enabled"):
        return []
    try:
        warmup = PufferfishWarmup(**options)
    except ValueError as error:  # name the group the user sets them in (lowrank_model.warmup_epochs=...)
        raise ValueError(f"lowrank_model options (lowrank_model.<name>=...): {error}") from error
    select_layers(module, warmup.keep_full_rank)  # a keep_full_rank pattern matching nothing fails here
    enable_factorized_loading(module)  # resuming from a checkpoint saved after the conversion
    return [warmup]


def build_logger(cfg: DictConfig, output_dir: Path, run_name: str):
    kind = cfg.logger.kind
    if kind == "wandb":
        from lightning.pytorch.loggers import WandbLogger

        os.environ.setdefault("WANDB_SILENT", "true")
        logger = WandbLogger(
            project=cfg.logger.project,
            name=run_name,
            save_dir=str(output_dir),
            mode=cfg.logger.mode,
            config=OmegaConf.to_container(cfg, resolve=True),
        )
        # Lightning passes anonymous=None, which W&B warns about as a setting that has no effect
        logger._wandb_init.pop("anonymous", None)
        return logger
    if kind == "csv":
        from lightning.pytorch.loggers import CSVLogger

        return CSVLogger(str(output_dir), name="csv")
    if kind == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        return TensorBoardLogger(str(output_dir), name="tensorboard")
    raise ValueError(f"logger.kind = {kind!r} is invalid; allowed: wandb, csv, tensorboard")


def check_added_keys(cfg: DictConfig, overrides: list[str]) -> None:
    """Refuse ``+key=value`` overrides that add a key the app does not read (Hydra suggests ``+`` for
    a key its config lacks, and the run would go on without it). Keys added to a role's group
    (``+compressor.x=1``) are left to the role, which refuses what it does not take."""
    for override in overrides:
        if not override.startswith("+") or override.startswith("++") or "=" not in override:
            continue
        key, value = override[1:].split("=", 1)
        if key.split(".")[0] in ROLE_GROUPS:
            continue
        raise ValueError(
            f"{key} is not an option of train.py ({override} adds a key no one reads){_meant(cfg, key, value)}"
        )


def _meant(cfg: DictConfig, key: str, value: str) -> str:
    """Where the option ``key`` most likely belongs: the chosen role's option of that name, another
    role's, or the closest key of the config."""
    leaf = key.split(".")[-1]
    for group in ROLE_GROUPS:
        if leaf in cfg[group] and leaf != "name":
            return f"; did you mean {group}.{leaf}={value}?"
    for group, registry in ROLE_GROUPS.items():
        takers = [name for name in registry.names() if leaf in registry.options(name)]
        if takers:
            return f"; {leaf} is an option of {group} {', '.join(takers)}: {group}={takers[0]} {group}.{leaf}={value}"
    keys = [f"{group}.{k}" if group else k for group, node in _sections(cfg) for k in node]
    match = closest(key, [k for k in keys if k != key])
    return f"; did you mean {match}={value}?" if match else ""


def _sections(cfg: DictConfig) -> list[tuple[str, DictConfig]]:
    top = {k: v for k, v in cfg.items() if not isinstance(v, DictConfig)}
    return [("", top), *((k, v) for k, v in cfg.items() if isinstance(v, DictConfig))]


def check_run(cfg: DictConfig) -> None:
    """Refuse what would waste or lose the run: an unknown ``checkpoints``, no step to train, a
    DiLoCo run that never reaches an outer step, and a baseline phase with no timed step in it or
    none left after it (its steps count within ``trainer.max_steps``)."""
    if cfg.checkpoints not in CHECKPOINTS:
        raise ValueError(f"checkpoints = {cfg.checkpoints!r} is invalid; allowed: {', '.join(CHECKPOINTS)}")
    if cfg.trainer.max_steps < 1:
        raise ValueError(f"trainer.max_steps = {cfg.trainer.max_steps} is invalid; allowed: an integer >= 1")
    baseline, warmup, steps = cfg.speedup.baseline_steps, cfg.speedup.warmup_steps, cfg.trainer.max_steps
    if baseline and baseline <= warmup:
        raise ValueError(
            f"speedup.baseline_steps = {baseline} is invalid with speedup.warmup_steps = {warmup}: no baseline "
            f"step would be timed; allowed: 0, or more than {warmup}"
        )
    if baseline and steps - baseline <= warmup:
        raise ValueError(
            f"speedup.baseline_steps = {baseline} is invalid with trainer.max_steps = {steps}: the baseline steps "
            f"count within max_steps, and no compressed step would be timed after speedup.warmup_steps = {warmup}; "
            f"allowed: {warmup + 1} to {steps - warmup - 1}, or trainer.max_steps >= {baseline + warmup + 1}"
        )
    if cfg.sync.name == "diloco" and cfg.sync.inner_steps > cfg.trainer.max_steps:
        raise ValueError(
            f"sync.inner_steps = {cfg.sync.inner_steps} is invalid with trainer.max_steps = {cfg.trainer.max_steps}: "
            f"no outer step would synchronise the replicas; allowed: at most {cfg.trainer.max_steps}"
        )


def checkpoint_folder(cfg: DictConfig, output_dir: Path) -> Path:
    """``checkpoint_dir``, or ``<run dir>/checkpoints`` where it is null."""
    return Path(cfg.checkpoint_dir) if cfg.checkpoint_dir is not None else output_dir / "checkpoints"


def build_checkpointing(cfg: DictConfig, folder: Path, tolerant: bool) -> list[pl.Callback]:
    """``checkpoints=last``: last.ckpt only; ``all``: also one per write; ``none``: nothing. With
    fault tolerance the groups reach each checkpoint at the same step, not at the same instant: none
    names its file ``-v1`` for finding the writer's there."""
    if cfg.checkpoints == "none":
        return []
    keep = -1 if cfg.checkpoints == "all" else 0
    every = cfg.trainer.checkpoint_every_n_steps
    return [
        ModelCheckpoint(
            dirpath=folder,
            save_last=True,
            save_top_k=keep,
            every_n_train_steps=every,
            enable_version_counter=not tolerant,
        )
    ]


def check_app(cfg: DictConfig) -> GCFusedStrategy | GCFSDPStrategy:
    """Every check made before any work, the library's included; the strategy."""
    check_run(cfg)
    check_app_setup(cfg)
    return build_strategy(cfg)


def run(cfg: DictConfig, output_dir: Path) -> dict:
    """Validate everything, then train; returns rank 0's summary (also in output_dir/summary.json)."""
    t = cfg.trainer
    torch.set_num_threads(t.threads_per_rank)
    strategy = check_app(cfg)
    ft = cfg.fault_tolerance
    tolerant = ft.lighthouse is not None  # a replica group, which ends with the others (FinishTogether)
    if tolerant:
        reach_lighthouse(fault_tolerance_of(cfg))  # a wrong address is reported before any rank starts
    pl.seed_everything(cfg.seed, verbose=False)
    module, data = build_recipe(cfg, cfg.seed)
    run_name = f"{cfg.model.get('arch', cfg.model.recipe)}-{cfg.compressor.name}-{fusion_spec(cfg.fusion)}"
    checkpoints = checkpoint_folder(cfg, output_dir)
    sequence = cfg.data[SEQUENCE_LENGTH[cfg.data.kind]] if cfg.data.kind in SEQUENCE_LENGTH else None
    monitor = ThroughputMonitor(
        cfg.data.batch_size,
        str(output_dir),
        cfg.speedup.baseline_steps,
        cfg.speedup.warmup_steps,
        tokens_per_sample=sequence,
    )
    demo = ft.kill_at is not None and ft.replica_group == ft.kill_group
    record = [StepRecord(output_dir / "steps.csv"), ParameterDigest(output_dir / "parameters.sha256"), FinishTogether()]
    trainer = pl.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        precision=t.precision,
        max_steps=t.max_steps,
        val_check_interval=min(t.val_check_interval, t.max_steps),
        check_val_every_n_epoch=None,
        log_every_n_steps=t.log_every_n_steps,
        strategy=strategy,
        logger=build_logger(cfg, output_dir, run_name),
        enable_checkpointing=cfg.checkpoints != "none",
        callbacks=[
            monitor,
            StepProgressBar(tokens_per_batch=sequence and sequence * cfg.data.batch_size),
            *build_lowrank_model(cfg, module),
            *build_checkpointing(cfg, checkpoints, tolerant),
            *([KillAt(ft.kill_at, ft.groups)] if demo else []),
            *(record if tolerant else []),
        ],
    )
    trainer.fit(module, datamodule=data, ckpt_path=cfg.ckpt_path)
    summary_file = output_dir / "summary.json"
    return OmegaConf.to_container(OmegaConf.load(summary_file)) if summary_file.exists() else {}


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    hydra_config = HydraConfig.get()
    output_dir = Path(hydra_config.runtime.output_dir)
    quiet_harmless_messages()
    overrides = list(hydra_config.overrides.task)
    try:
        check_added_keys(cfg, overrides)
        if cfg.fault_tolerance.lighthouse == "local":
            check_demo(cfg)
            check_app(OmegaConf.merge(cfg, demo_group(cfg, overrides)))  # each group's, before any starts
            sys.exit(run_replica_groups(cfg, output_dir, overrides))
        summary = run(cfg, output_dir)
    except (ValueError, ImportError, LighthouseUnreachable, MissingDataset) as error:
        print(f"error: {error}", file=sys.stderr)
        remove_unused_run_folder(output_dir)
        sys.exit(2)
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        print_summary(cfg, summary, output_dir)


def demo_group(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """What the demo changes in a group's configuration, for checking it before any group starts
    (no kill, and the group's devices: :func:`app.replica_groups.group_devices`)."""
    group = {"kill_group": None, "kill_at": None}
    return OmegaConf.create({"fault_tolerance": group, "trainer": {"devices": group_devices(cfg, overrides)}})


def remove_unused_run_folder(output_dir: Path) -> None:
    """A refused run leaves no folder: remove the run folder where it holds Hydra's record alone."""
    if output_dir.is_dir() and {p.name for p in output_dir.iterdir()} <= {".hydra"}:
        shutil.rmtree(output_dir)


def print_summary(cfg: DictConfig, summary: dict, output_dir: Path) -> None:
    """Rank 0's closing lines: the median step and the speedup, the last validation, and where the
    outputs went."""
    if not summary:
        print(
            f"\nno step was timed: all trainer.max_steps = {cfg.trainer.max_steps} fell within "
            f"speedup.warmup_steps = {cfg.speedup.warmup_steps} (lower it to time short runs)"
        )
    else:
        speedup = summary.get("speedup_vs_fp32_allreduce_measured")
        estimate = summary.get("speedup_vs_fp32_allreduce_estimated_by_timeline_model")
        if speedup:
            verdict = f"{speedup:.2f}x (measured)"
        elif estimate:
            verdict = f"{estimate:.2f}x (timeline-model estimate; set speedup.baseline_steps=N to measure it)"
        else:
            verdict = "not measured (set speedup.baseline_steps=N, or fusion=auto for an estimate)"
        tokens = summary.get("throughput_tokens_per_s")
        throughput = f"{summary['throughput_samples_per_s']:.1f} samples/s" + (
            f" ({tokens:,.0f} tokens/s)" if tokens else ""
        )
        print(
            f"\nmedian step {summary['step_time_s']:.3f} s, {throughput}, "
            f"compression ratio {summary.get('compression_ratio', 1.0):.1f}, speedup vs fp32 allreduce: {verdict}"
        )
        validation = {k: v for k, v in summary.items() if k.startswith("val/")}
        if validation:
            metrics = ", ".join(f"{k} {v:.4g}" for k, v in sorted(validation.items()))
            print(f"last validation (step {summary['val_step']}): {metrics}")
        if "auto_plan_buckets" in summary:
            print(
                f"fusion=auto plan: {summary['auto_plan_buckets']} buckets, predicted step "
                f"{summary['auto_plan_predicted_step_s']:.3f} s"
            )
        if "wandb_dir" in summary:
            print(f"W&B run: {Path(summary['wandb_dir']).parent}")
    print(f"checkpoints: {checkpoints_written(cfg, output_dir)}")
    if summary:
        print(f"summary: {output_dir / 'summary.json'}")


def checkpoints_written(cfg: DictConfig, output_dir: Path) -> str:
    """Where this run's checkpoints are, as the closing lines say it."""
    if cfg.checkpoints == "none":
        return "none kept (checkpoints=none)"
    folder = checkpoint_folder(cfg, output_dir)
    if folder.is_dir():
        return str(folder)
    if cfg.fault_tolerance.lighthouse is not None:  # one group writes each checkpoint, into its own folder
        return (
            f"written by another replica group (this group's state files: {folder}.gc_state); set checkpoint_dir= "
            "to a folder every group reaches to keep them together"
        )
    return "none written"


if __name__ == "__main__":
    main()
