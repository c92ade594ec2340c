"""The GPT recipe: its decoder (causal, tied, its parameter count), the corpus loader on generated
files, ``compressor=none`` against Lightning's ``ddp``, and the app's runs with it."""

import csv
import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from locations import ROOT
from models import fit, flat_params

from gc_strategy import GCFusedStrategy

sys.path.insert(0, str(ROOT))

from recipes.corpus import CorpusDataModule, MissingDataset  # noqa: E402
from recipes.gpt import GPT, IGNORE, GPTLanguageModel  # noqa: E402


def small_gpt(vocab: int = 40, context: int = 16, width: int = 32, layers: int = 2, heads: int = 4) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab, context, width, layers, heads, dropout=0.0).eval()


def test_a_tokens_output_does_not_change_when_later_tokens_change():
    gpt = small_gpt()
    ids = torch.randint(0, 40, (3, 16), generator=torch.Generator().manual_seed(1))
    for t in (0, 5, 15):
        changed = ids.clone()
        changed[:, t:] = (changed[:, t:] + 7) % 40
        with torch.no_grad():
            before, after = gpt(ids), gpt(changed)
        assert torch.equal(before[:, :t], after[:, :t])
        assert not torch.allclose(before[:, t:], after[:, t:])  # the changed tokens do count


@pytest.mark.parametrize("vocab, context, width, layers", [(256, 128, 128, 2), (40, 16, 32, 3), (50257, 1024, 768, 12)])
def test_the_parameter_count_is_the_formulas(vocab, context, width, layers):
    """Counted by hand: the embeddings V·d and C·d; per block two LayerNorms (2·2d), the
    query/key/value projection (3d·d + 3d), the output projection (d·d + d), the MLP (d·4d + 4d
    and 4d·d + d); the final LayerNorm 2d; the output tied (nothing)."""
    per_block = 2 * 2 * width + (3 * width * width + 3 * width) + (width * width + width)
    per_block += (width * 4 * width + 4 * width) + (4 * width * width + width)
    expected = vocab * width + context * width + layers * per_block + 2 * width
    with torch.device("meta"):
        gpt = GPT(vocab, context, width, layers, heads=4, dropout=0.0)
    assert sum(p.numel() for p in gpt.parameters()) == expected
    if (vocab, width, layers) == (50257, 768, 12):
        assert 124e6 < expected < 125e6  # GPT-2 small


def test_the_output_is_tied_to_the_token_embedding():
    """A token absent from the input reaches the logits through the tied output only: changing its
    embedding row changes its logit, and no other."""
    gpt = small_gpt()
    ids = torch.randint(0, 39, (2, 16), generator=torch.Generator().manual_seed(2))  # token 39 absent
    with torch.no_grad():
        before = gpt(ids)
        gpt.tokens.weight[39] += 0.5
        after = gpt(ids)
    assert not torch.allclose(before[..., 39], after[..., 39])
    assert torch.equal(before[..., :39], after[..., :39])
    assert not [n for n, p in gpt.named_parameters() if p.shape == gpt.tokens.weight.shape and n != "tokens.weight"]


def test_a_width_that_the_heads_do_not_divide_is_refused():
    with pytest.raises(ValueError, match=r"model.width = 30 must be a multiple of model.heads = 4"):
        GPT(40, 16, 30, 1, 4, 0.0)


def write_corpus(folder, count: int = 30):
    """``count`` text files in nested folders, each of its own bytes (some not ASCII)."""
    files = {}
    for i in range(count):
        path = folder / f"part{i % 3}" / f"file{i}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        data = (f"file {i}: " + "é→ line\n" * (i + 1)).encode()
        path.write_bytes(data)
        files[path.relative_to(folder).as_posix()] = data
    (folder / "skipped.bin").write_bytes(b"\x00" * 100)  # not a corpus suffix
    return files


def test_the_split_is_by_file_deterministic_disjoint_and_every_byte_is_read_once_per_epoch(tmp_path):
    files = write_corpus(tmp_path)
    options = dict(data_dir=str(tmp_path), suffixes=[".txt"], validation_fraction=0.3, context=8)
    data = CorpusDataModule(**options, val_tokens=None)
    train, validation = data.split()
    names = tuple({f.relative_to(tmp_path).as_posix() for f in chosen} for chosen in (train, validation))
    assert not names[0] & names[1] and names[0] | names[1] == set(files)
    # the split is a file's own: the first byte of its path's SHA-256 against 0.3 · 256
    assert names[1] == {n for n in files if hashlib.sha256(n.encode()).digest()[0] < 0.3 * 256}
    assert CorpusDataModule(**options).split() == (train, validation)
    data.setup("fit")
    for dataset, chosen in ((data.train_set, train), (data.val_set, validation)):
        stream = b"".join(files[f.relative_to(tmp_path).as_posix()] for f in chosen)
        inputs, targets = [], []
        for i in range(len(dataset)):
            x, y = dataset[i]
            kept = y != IGNORE
            inputs += x[kept].tolist()
            targets += y[kept].tolist()
        assert bytes(inputs) == stream[:-1] and bytes(targets) == stream[1:]


def test_the_default_corpus_is_the_standard_librarys_source(tmp_path):
    data = CorpusDataModule(context=8)
    train, validation = data.split()
    assert any(f.name == "os.py" for f in train + validation)
    assert all(f.suffix in (".py", ".txt", ".md") for f in train + validation)
    assert not [f for f in train + validation if "site-packages" in f.parts]


def test_a_missing_or_empty_folder_and_a_missing_tokenizer_are_refused(tmp_path):
    with pytest.raises(MissingDataset, match="is not a folder; or use data=synthetic_bytes"):
        CorpusDataModule(data_dir=str(tmp_path / "absent")).check_present()
    with pytest.raises(MissingDataset, match=r"holds no file ending in \.py, \.txt, \.md"):
        CorpusDataModule(data_dir=str(tmp_path)).setup("fit")
    with pytest.raises(MissingDataset, match="data.tokenizer_path = 'none.json': no such file"):
        CorpusDataModule(data_dir=str(tmp_path), tokenizer_path="none.json")
    with pytest.raises(ValueError, match=r"data.name = 'web' is invalid; allowed: 'files', 'synthetic'"):
        CorpusDataModule(name="web")


def test_a_local_tokenizer_file_replaces_bytes(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    corpus = tmp_path / "corpus"
    files = write_corpus(corpus)
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train([str(corpus / n) for n in files], trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]"]))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    data = CorpusDataModule(data_dir=str(corpus), tokenizer_path=str(tmp_path / "tokenizer.json"), context=8)
    assert data.vocab_size == tokenizer.get_vocab_size()
    data.setup("fit")
    train, _ = data.split()
    expected = [i for f in train for i in tokenizer.encode(f.read_text()).ids]
    assert data.train_set.ids.tolist() == expected


class ParityGPT(GPTLanguageModel):
    """The recipe on synthetic bytes; every rank checks at the end that it holds rank 0's parameters."""

    def __init__(self) -> None:
        super().__init__(vocab_size=256, context=16, width=32, layers=2, heads=4)
        self.data = CorpusDataModule(name="synthetic", context=16, batch_size=4, train_tokens=16 * 4 * 2 * 6)
        self.data.setup("fit")

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data.train_set, batch_size=4, shuffle=False)

    def on_train_end(self) -> None:
        flat = flat_params(self)
        gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flat)
        assert all(torch.equal(g, gathered[0]) for g in gathered), "ranks hold different parameters"


@pytest.mark.slow
def test_compressor_none_on_the_gpt_equals_lightnings_ddp():
    torch.manual_seed(0)
    reference = ParityGPT()
    fit(reference, "ddp_fork")
    torch.manual_seed(0)
    module = ParityGPT()
    fit(module, GCFusedStrategy(start_method="fork"))
    assert (flat_params(module) - flat_params(reference)).abs().max() <= 1e-6


def run_app(tmp_path, *options: str) -> tuple[subprocess.CompletedProcess, list[list[dict]]]:
    """The app on the GPT and the default corpus, 4 steps with a validation every 2; its console,
    and each metrics.csv's validation rows."""
    run = tmp_path / "run"
    args = ["model=gpt", "data=text", "data.val_tokens=4096", "logger=csv", "trainer.max_steps=4"]
    args += ["trainer.val_check_interval=2", "trainer.checkpoint_every_n_steps=4", "trainer.log_every_n_steps=1"]
    args += ["speedup.warmup_steps=0", f"hydra.run.dir={run}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", "COLUMNS": "200"}  # the bar unabridged
    done = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args, *options],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    files = sorted(run.rglob("metrics.csv"))
    return done, [[r for r in csv.DictReader(f.open()) if r.get("val/ppl")] for f in files]


def assert_perplexity_reported(rows: list[dict]) -> None:
    """Two validations, each perplexity the exponential of its loss, and the second lower."""
    assert len(rows) == 2
    assert_perplexity_is_exp_loss(rows)
    assert float(rows[1]["val/ppl"]) < float(rows[0]["val/ppl"])  # it learns


def assert_perplexity_is_exp_loss(rows: list[dict]) -> None:
    for row in rows:
        assert abs(float(row["val/ppl"]) / torch.tensor(float(row["val/loss"])).exp().item() - 1) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        ["compressor=topk", "compressor.density=0.05", "memory=residual"],
        ["compressor=powersgd", "sync=diloco", "sync.inner_steps=2"],
        ["trainer.sharding=fsdp", "compressor=topk", "memory=residual"],
    ],
    ids=["topk", "diloco", "fsdp"],
)
def test_the_app_trains_the_gpt_on_the_default_corpus_and_reports_perplexity(tmp_path, options):
    done, validations = run_app(tmp_path, *options)
    assert len(validations) == 1
    assert_perplexity_reported(validations[0])
    assert "last validation (step 4): val/loss " in done.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["throughput_tokens_per_s"] == pytest.approx(summary["throughput_samples_per_s"] * 128)
    assert f"({summary['throughput_tokens_per_s']:,.0f} tokens/s)" in done.stdout
    steps = [r for f in (tmp_path / "run").rglob("metrics.csv") for r in csv.DictReader(f.open())]
    assert len([r for r in steps if r.get("perf/tokens_per_s")]) == 4
    assert "Tokens (epoch 0)" in done.stdout and "16.38k/16.38k tokens" in done.stdout  # 4 steps × 2 × 16 × 128


@pytest.mark.slow
@pytest.mark.parametrize(
    "sync",
    [
        [],
        ["sync=diloco", "sync.inner_steps=2", "sync.fragments=2", "sync.overlap_steps=1"],
        ["trainer.sharding=fsdp"],
        ["trainer.sharding=fsdp", "sync=diloco", "sync.inner_steps=2"],
    ],
    ids=["every_step", "streaming_diloco", "sharded", "sharded_diloco"],
)
def test_the_app_trains_the_gpt_in_fault_tolerant_replica_groups_of_two_ranks(tmp_path, sync):
    pytest.importorskip("torchft")
    demo = ["fault_tolerance.lighthouse=local", "fault_tolerance.groups=2", "trainer.devices=2"]
    done, validations = run_app(tmp_path, *demo, *sync)
    assert "2 replica groups (2 processes each)" in done.stdout
    assert "all 2 replica groups ended at step" in done.stdout and "with the same parameters" in done.stdout
    assert len(validations) == 2
    for rows in validations:  # a group that healed mid-run validated only after it healed
        assert rows
        assert_perplexity_is_exp_loss(rows)
        assert float(rows[-1]["val/ppl"]) < 256  # below a uniform guess over the 256 bytes: it learned
