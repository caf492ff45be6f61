"""Data pipeline: corpus split, packing, dp sharding, exact resume, local sources, bad input (no network)."""

from __future__ import annotations

import json
import os
import zlib
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from models.errors import ConfigError
from tests.trainer.test_tokenizer import make_hf_tokenizer
from trainer.data import (
    Batch,
    DataLoader,
    TokenWindows,
    _builtin_files,
    build_dataloader,
    builtin_root,
    load_documents,
    tokenize_documents,
)
from trainer.data.tokenizer import ByteTokenizer, HFTokenizer


@dataclass
class Cfg:
    """Mirror of trainer.config.DataConfig (the module only reads these attributes)."""

    source: str = "builtin"
    path: Optional[str] = None
    name: Optional[str] = None
    split: str = "train"
    text_field: str = "text"
    tokenizer: str = "byte"
    val_fraction: float = 0.01
    max_documents: Optional[int] = None
    shuffle: bool = True


@pytest.fixture(autouse=True)
def _isolated_hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep datasets' arrow cache inside the test's tmp dir and forbid Hub access."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def loader(tokens: torch.Tensor, seq_len: int = 4, **kw: Any) -> DataLoader:
    args: dict[str, Any] = dict(global_batch_size=8, dp_rank=0, dp_size=1, seed=0, shuffle=True)
    args.update(kw)
    return DataLoader(TokenWindows(tokens, seq_len), **args)


def global_step(tokens: torch.Tensor, dp_size: int, steps: int, **kw: Any) -> list[Batch]:
    """Run ``steps`` steps on every rank of ``dp_size``; return each step's rank-ordered concat."""
    loaders = [loader(tokens, dp_rank=r, dp_size=dp_size, **kw) for r in range(dp_size)]
    out = []
    for _ in range(steps):
        parts = [ld.next_batch() for ld in loaders]
        out.append(Batch(torch.cat([p.inputs for p in parts]), torch.cat([p.labels for p in parts])))
    return out


def assert_same_batches(a: list[Batch], b: list[Batch]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x.inputs, y.inputs) and torch.equal(x.labels, y.labels)


TOKENS = torch.arange(1000, dtype=torch.int32)  # 249 windows of 4: every window is identifiable


# ------------------------------------------------------------------------- builtin corpus


@pytest.fixture(scope="module")
def builtin_splits() -> tuple[list[str], list[str]]:
    cfg = Cfg()
    return load_documents(cfg, "train"), load_documents(cfg, "validation")


def test_builtin_corpus_split_is_a_deterministic_partition(
    builtin_splits: tuple[list[str], list[str]],
) -> None:
    train, val = builtin_splits
    root = builtin_root()
    files = _builtin_files(root)
    assert len(files) > 100 and files == sorted(files)
    assert not any(p.startswith(("site-packages/", "dist-packages/")) for p in files)
    assert train and val and len(train) + len(val) == len(files)
    # The validation files are exactly those whose path hashes below 1% of the buckets.
    val_files = [p for p in files if zlib.crc32(p.encode()) % 10_000 < 100]
    assert val_files
    read = {p: Path(root, p).read_text(encoding="utf-8", errors="replace") for p in files}
    assert val == [read[p] for p in val_files]
    assert Counter(train) + Counter(val) == Counter(read.values())
    # A second load is identical (same order, same split).
    assert load_documents(Cfg(), "validation") == val
    assert load_documents(Cfg(max_documents=50, val_fraction=0.0), "train") == [read[p] for p in files[:50]]


def test_builtin_dataloader_packs_bos_eos(builtin_splits: tuple[list[str], list[str]]) -> None:
    train, _ = builtin_splits
    tok = ByteTokenizer()
    dl = build_dataloader(
        Cfg(shuffle=False), tok, split="train", seq_len=256, global_batch_size=8, dp_rank=0, dp_size=1, seed=0
    )
    flat = dl.windows.tokens
    assert flat.dtype == torch.int16  # byte vocab fits: half the memory of int32
    assert dl.windows.num_tokens == sum(len(d.encode()) + 2 for d in train)
    assert dl.windows.num_windows == (dl.windows.num_tokens - 1) // 256
    first = train[0].encode()
    assert flat[0] == tok.bos_id and flat[1 : 1 + len(first)].tolist() == list(first)
    assert flat[1 + len(first)] == tok.eos_id and flat[2 + len(first)] == tok.bos_id
    batch = dl.next_batch()
    assert batch.inputs.shape == batch.labels.shape == (8, 256) and batch.inputs.dtype == torch.int64
    assert torch.equal(batch.inputs.flatten(), flat[: 8 * 256].long())  # sequential when not shuffled


# -------------------------------------------------------------------------------- packing


def test_tokenize_documents_places_bos_eos() -> None:
    flat = tokenize_documents(["ab", "", "é"], ByteTokenizer())
    assert flat.tolist() == [256, 97, 98, 257, 256, 257, 256, 0xC3, 0xA9, 257]


class _ListTokenizer:
    """A big-vocab tokenizer with only ``encode``: exercises the generic int32 path."""

    vocab_size, bos_id, eos_id = 50_000, 49_998, 49_999

    def encode(self, text: str) -> list[int]:
        return [40_000 + ord(c) % 100 for c in text]

    def decode(self, ids: list[int]) -> str:
        return ""


def test_tokenize_documents_generic_path_uses_int32() -> None:
    tok = _ListTokenizer()
    flat = tokenize_documents(["ab", "c"], tok)
    assert flat.dtype == torch.int32
    assert flat.tolist() == [49_998, *tok.encode("ab"), 49_999, 49_998, *tok.encode("c"), 49_999]


def test_windows_are_shifted_slices_of_the_flat_stream() -> None:
    flat = torch.randint(0, 258, (103,), generator=torch.Generator().manual_seed(0)).to(torch.int16)
    w = TokenWindows(flat, 10)
    assert w.num_windows == 10 and w.num_tokens == 103
    for k in range(w.num_windows):
        inputs, labels = w.window(k)
        assert inputs.dtype == labels.dtype == torch.int64
        assert torch.equal(inputs, flat[k * 10 : k * 10 + 10].long())
        assert torch.equal(labels, flat[k * 10 + 1 : k * 10 + 11].long())
    batch = w.gather(torch.tensor([3, 0]))
    assert torch.equal(batch.inputs[0], w.window(3)[0]) and torch.equal(batch.labels[1], w.window(0)[1])
    assert TokenWindows(flat[:11], 10).num_windows == 1 and TokenWindows(flat[:10], 10).num_windows == 0


# ------------------------------------------------------------------------------- sharding


@pytest.mark.parametrize("shuffle", [True, False])
def test_dp_shards_concatenate_to_the_single_rank_batch(shuffle: bool) -> None:
    steps = 70  # 249 windows / 8 per step: crosses two epoch boundaries
    ref = global_step(TOKENS, 1, steps, shuffle=shuffle)
    for dp_size in (2, 4):
        assert_same_batches(global_step(TOKENS, dp_size, steps, shuffle=shuffle), ref)
    loaders = [loader(TOKENS, dp_rank=r, dp_size=4) for r in range(4)]
    starts = [set(ld.next_batch().inputs[:, 0].tolist()) for ld in loaders]  # step 0, inside epoch 0
    assert all(len(s) == 2 for s in starts) and len(set().union(*starts)) == 8


def test_epochs_wrap_with_new_permutation_and_no_shuffle_is_sequential() -> None:
    n = TokenWindows(TOKENS[:129], 4).num_windows  # 32 windows = 4 steps of 8 per epoch
    assert n == 32
    dl = loader(TOKENS[:129])
    epochs = [torch.cat([dl.next_batch().inputs[:, 0] for _ in range(4)]) // 4 for _ in range(3)]
    for e, order in enumerate(epochs):
        assert sorted(order.tolist()) == list(range(n))  # each epoch visits every window once
        assert torch.equal(order, torch.randperm(n, generator=torch.Generator().manual_seed(e)))
    assert not torch.equal(epochs[0], epochs[1]) and dl.epoch == 3
    seq = loader(TOKENS[:129], shuffle=False, seed=123)
    order = torch.cat([seq.next_batch().inputs[:, 0] for _ in range(8)]) // 4
    assert order.tolist() == list(range(n)) * 2
    seq.reset()
    assert seq.next_batch().inputs[:, 0].tolist() == [4 * i for i in range(8)]


def test_dataloader_argument_validation() -> None:
    with pytest.raises(ConfigError, match="global_batch_size=6"):
        loader(TOKENS, global_batch_size=6, dp_size=4)
    with pytest.raises(ConfigError, match="dp_rank=4"):
        loader(TOKENS, dp_rank=4, dp_size=4)
    with pytest.raises(ConfigError, match="global_batch_size=300"):
        loader(TOKENS, global_batch_size=300)
    with pytest.raises(ConfigError, match="seq_len=0"):
        TokenWindows(TOKENS, 0)


# -------------------------------------------------------------------------------- resume


def test_resume_matches_uninterrupted_run() -> None:
    ref = global_step(TOKENS, 1, 50)
    first = loader(TOKENS)
    for _ in range(20):
        first.next_batch()
    sd = first.state_dict()
    assert sd == {"samples_seen": 160, "global_batch_size": 8, "seed": 0, "shuffle": True, "num_windows": 249}
    resumed = loader(TOKENS)
    resumed.load_state_dict(sd)
    assert_same_batches([resumed.next_batch() for _ in range(30)], ref[20:])


def test_resume_with_a_different_dp_size_continues_at_the_same_sample() -> None:
    ref = global_step(TOKENS, 1, 40)
    old = [loader(TOKENS, dp_rank=r, dp_size=4) for r in range(4)]
    for _ in range(25):
        for ld in old:
            ld.next_batch()
    sds = [ld.state_dict() for ld in old]
    assert all(sd == sds[0] for sd in sds)  # the state is global: identical on every rank
    new = [loader(TOKENS, dp_rank=r, dp_size=2) for r in range(2)]
    for ld in new:
        ld.load_state_dict(sds[0])
    for t in range(25, 40):
        parts = [ld.next_batch() for ld in new]
        assert torch.equal(torch.cat([p.inputs for p in parts]), ref[t].inputs)


def test_resume_with_other_global_batch_size() -> None:
    first = loader(TOKENS)
    for _ in range(5):
        first.next_batch()  # 40 samples
    smaller = loader(TOKENS, global_batch_size=4)
    smaller.load_state_dict(first.state_dict())
    assert torch.equal(smaller.next_batch().inputs, global_step(TOKENS, 1, 6)[5].inputs[:4])
    with pytest.raises(ConfigError, match="global_batch_size=16"):
        loader(TOKENS, global_batch_size=16).load_state_dict(first.state_dict())


@pytest.mark.parametrize(
    "other, match",
    [
        (dict(tokens=TOKENS[:900]), "num_windows=249"),
        (dict(seed=1), "seed=0"),
        (dict(shuffle=False), "shuffle=True"),
    ],
)
def test_resume_on_different_data_raises(other: dict[str, Any], match: str) -> None:
    first = loader(TOKENS)
    first.next_batch()
    tokens = other.pop("tokens", TOKENS)
    with pytest.raises(ConfigError, match=match):
        loader(tokens, **other).load_state_dict(first.state_dict())
    with pytest.raises(ConfigError, match="missing"):
        loader(TOKENS).load_state_dict({"samples_seen": 8})


# ------------------------------------------------------------------------- local sources


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    return write(path, "".join(json.dumps(r) + "\n" for r in rows))


def test_text_directory_glob_and_file(tmp_path: Path) -> None:
    d = tmp_path / "corpus"
    write(d / "b.txt", "bee\nbuzz\n")
    write(d / "a.txt", "ay")
    write(d / "sub" / "c.md", "# see")
    write(d / "skip.bin", "binary")
    write(d / ".hidden" / "x.txt", "hidden")
    cfg = Cfg(source="text", path=str(d), val_fraction=0.0)
    assert load_documents(cfg, "train") == ["ay", "bee\nbuzz\n", "# see"]  # sorted paths, one doc per file
    assert load_documents(cfg, "validation") == []
    assert load_documents(replace(cfg, path=str(d / "*.txt")), "train") == ["ay", "bee\nbuzz\n"]
    assert load_documents(replace(cfg, path=str(d / "**" / "*.md")), "train") == ["# see"]
    assert load_documents(replace(cfg, path=str(d / "a.txt")), "train") == ["ay"]


def test_jsonl_rows_text_field_cap_and_fallback_validation(tmp_path: Path) -> None:
    rows = [{"content": f"doc {i}", "id": i} for i in range(7)] + [{"content": None, "id": 7}]
    path = write_jsonl(tmp_path / "data" / "part-0.jsonl", rows)
    cfg = Cfg(source="json", path=str(path), text_field="content")
    # crc32 of "0".."7" puts none below 1% of the buckets: the last training doc becomes validation.
    assert load_documents(cfg, "validation") == ["doc 6"]
    assert load_documents(cfg, "train") == [f"doc {i}" for i in range(6)]  # the null row is skipped
    assert load_documents(replace(cfg, source="jsonl", val_fraction=0.05), "validation") == [
        "doc 0"
    ]  # crc32("0") % 1e4 = 209
    assert load_documents(replace(cfg, max_documents=3, val_fraction=0.0), "train") == [
        "doc 0",
        "doc 1",
        "doc 2",
    ]
    write_jsonl(tmp_path / "data" / "part-1.jsonl", [{"content": "doc 8", "id": 8}])
    both = load_documents(replace(cfg, path=str(tmp_path / "data"), val_fraction=0.0), "train")
    assert both == [f"doc {i}" for i in range(7)] + ["doc 8"]


def test_parquet_loads(tmp_path: Path) -> None:
    import datasets

    datasets.Dataset.from_dict({"text": ["alpha", "beta", "gamma"]}).to_parquet(
        str(tmp_path / "p" / "x.parquet")
    )
    cfg = Cfg(source="parquet", path=str(tmp_path / "p"), val_fraction=0.0)
    assert load_documents(cfg, "train") == ["alpha", "beta", "gamma"]


def test_hf_tokenizer_end_to_end(tmp_path: Path) -> None:
    tok = HFTokenizer(make_hf_tokenizer(tmp_path / "tokenizer.json", ["<s>", "</s>"]))
    texts = [f"def main():\n    return {i}\n" for i in range(40)]
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    cfg = Cfg(source="json", path=str(path), tokenizer=str(tmp_path / "tokenizer.json"), shuffle=False)
    dl = build_dataloader(
        cfg, tok, split="train", seq_len=16, global_batch_size=4, dp_rank=1, dp_size=2, seed=0
    )
    train = load_documents(cfg, "train")
    expected = torch.cat([torch.tensor([tok.bos_id, *tok.encode(t), tok.eos_id]) for t in train])
    assert torch.equal(dl.windows.tokens.long(), expected)
    batch = dl.next_batch()  # rank 1 of 2: windows 2 and 3
    assert batch.inputs.shape == (2, 16)
    assert torch.equal(batch.inputs[0], expected[32:48]) and torch.equal(batch.labels[1], expected[49:65])
    assert tok.decode(dl.windows.tokens[: len(expected) // len(train)].tolist()).startswith("def main")


def test_hub_source_calls_load_dataset(monkeypatch: pytest.MonkeyPatch) -> None:
    """No network: a fake load_dataset checks the arguments, streaming when capped, error wrapping."""
    import datasets

    calls: list[tuple[Any, ...]] = []
    rows = [{"text": f"story {i}", "id": i} for i in range(5)]

    def fake_load_dataset(path: str, name: Optional[str], *, split: str, streaming: bool = False) -> Any:
        calls.append((path, name, split, streaming))
        if path != "org/stories":
            raise FileNotFoundError(f"Dataset '{path}' doesn't exist on the Hub")
        return iter(rows) if streaming else datasets.Dataset.from_list(rows)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    cfg = Cfg(source="hub", path="org/stories", name="v1", split="train", val_fraction=0.0)
    assert load_documents(cfg, "train") == [r["text"] for r in rows]
    assert load_documents(replace(cfg, max_documents=2), "train") == ["story 0", "story 1"]
    assert calls == [("org/stories", "v1", "train", False), ("org/stories", "v1", "train", True)]
    with pytest.raises(ConfigError, match="'body'"):
        load_documents(replace(cfg, text_field="body"), "train")
    with pytest.raises(ConfigError, match="org/typo"):
        load_documents(replace(cfg, path="org/typo"), "train")


# ---------------------------------------------------------------------------- bad input


def test_missing_empty_and_unreadable_paths_raise(tmp_path: Path) -> None:
    missing = tmp_path / "does-not-exist"
    with pytest.raises(ConfigError, match="does-not-exist"):
        load_documents(Cfg(source="text", path=str(missing)), "train")
    (tmp_path / "empty").mkdir()
    write(tmp_path / "empty" / "notes.csv", "a,b")  # wrong extension does not count
    with pytest.raises(ConfigError, match="empty"):
        load_documents(Cfg(source="json", path=str(tmp_path / "empty")), "train")
    with pytest.raises(ConfigError, match="nomatch"):
        load_documents(Cfg(source="text", path=str(tmp_path / "nomatch*.txt")), "train")
    with pytest.raises(ConfigError, match="needs a path"):
        load_documents(Cfg(source="parquet"), "train")


def test_dangling_symlink_in_directory_raises(tmp_path: Path) -> None:
    """Unreadable regardless of user (root reads chmod-000 files): a link to nowhere."""
    write(tmp_path / "d" / "a.txt", "fine")
    os.symlink(tmp_path / "gone.txt", tmp_path / "d" / "dangling.txt")
    with pytest.raises(ConfigError, match="dangling.txt"):
        load_documents(Cfg(source="text", path=str(tmp_path / "d")), "train")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file_raises(tmp_path: Path) -> None:
    path = write(tmp_path / "locked.txt", "secret")
    path.chmod(0)
    try:
        with pytest.raises(ConfigError, match="locked.txt"):
            load_documents(Cfg(source="text", path=str(path)), "train")
    finally:
        path.chmod(0o644)


def test_malformed_files_raise_naming_the_file(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "j" / "good.jsonl", [{"text": "fine"}])
    write(tmp_path / "j" / "broken.jsonl", '{"text": "ok"}\n{"text": \n')
    with pytest.raises(ConfigError, match="broken.jsonl"):
        load_documents(Cfg(source="json", path=str(tmp_path / "j")), "train")
    write(tmp_path / "bad.parquet", "not parquet at all")
    with pytest.raises(ConfigError, match="bad.parquet"):
        load_documents(Cfg(source="parquet", path=str(tmp_path / "bad.parquet")), "train")


def test_jsonl_without_text_field_raises(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "rows.jsonl", [{"body": "x"}, {"body": "y"}])
    with pytest.raises(ConfigError, match="'text'.*body"):
        load_documents(Cfg(source="json", path=str(path)), "train")
    with pytest.raises(ConfigError, match="'id'.*int"):
        load_documents(
            Cfg(source="json", path=str(write_jsonl(tmp_path / "ids.jsonl", [{"id": 1}])), text_field="id"),
            "train",
        )


def test_corpus_too_small_for_one_batch_raises(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "tiny.jsonl", [{"text": "short"}, {"text": "tiny"}])
    cfg = Cfg(source="json", path=str(path), val_fraction=0.0)
    with pytest.raises(ConfigError, match="global_batch_size=8") as info:
        build_dataloader(
            cfg, ByteTokenizer(), split="train", seq_len=64, global_batch_size=8, dp_rank=0, dp_size=1, seed=0
        )
    assert "seq_len=64" in str(info.value) and "global_batch_size=8" in str(info.value)


def test_config_errors_name_the_value(tmp_path: Path) -> None:
    path = str(write_jsonl(tmp_path / "one.jsonl", [{"text": "only doc"}]))
    with pytest.raises(ConfigError, match="val_fraction=0.01"):  # the only doc would be held out
        load_documents(Cfg(source="json", path=path), "train")
    with pytest.raises(ConfigError, match="val_fraction=0.0"):  # no validation split
        build_dataloader(
            Cfg(source="json", path=path, val_fraction=0.0),
            ByteTokenizer(),
            split="validation",
            seq_len=2,
            global_batch_size=1,
            dp_rank=0,
            dp_size=1,
            seed=0,
        )
    with pytest.raises(ConfigError, match="val_fraction=1.5"):
        load_documents(Cfg(val_fraction=1.5), "train")
    with pytest.raises(ConfigError, match="'csv'"):
        load_documents(Cfg(source="csv", path=path), "train")
    with pytest.raises(ConfigError, match="'/some/where'"):
        load_documents(Cfg(path="/some/where"), "train")
    with pytest.raises(ConfigError, match="'test'"):
        load_documents(Cfg(), "test")
    with pytest.raises(ConfigError, match="max_documents=0"):
        load_documents(Cfg(max_documents=0), "train")
