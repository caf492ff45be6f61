"""Loading a checkpoint never runs code from it (``trainer/checkpoint/reader.py``).

A DCP ``.metadata`` is a pickle, and so is every BYTES entry (non-tensor state) in the data
files. A checkpoint whose ``.metadata`` or a bytes entry was replaced by a crafted pickle (its
``checkpoint.json`` sizes and CRC32s updated to match) must be refused at every entry point:
``checkpoint.initial_load_path``, resume from the run folder, ``trainer.generate``,
``trainer.export_hf`` -- with a message naming the file and the class, a clean exit 2 for the
CLIs, and the payload's marker file never created. ``trainer.plan --run`` reads no checkpoint
(only ``config.yaml`` and ``metrics.jsonl``) and is checked not to. Every payload is shown to
work against a plain unpickler (positive controls), so the refusals are not vacuous.

Checkpoints are written once per module (one single-process launch: sync and async saves; one
2-rank FSDP launch); the CLIs run as concurrent subprocesses.
"""

from __future__ import annotations

import ast
import builtins
import io
import json
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from models.errors import ConfigError
from tests.configs import REPO, TINY, tiny_config
from tests.dist import run_distributed
from trainer.checkpoint.reader import CheckpointReader, UnsafeCheckpointError, dcp_load, metadata_globals
from trainer.checkpoint.storage import MARKER, file_crc32, load_full_state, read_metadata

RUN = ("checkpoint.enable=true", "training.steps=2")
FSDP = ("parallelism.dp_shard=2",)
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


# -- payloads ----------------------------------------------------------------------------


class _Payload:
    """Pickles as ``fn(*args)``: what a crafted checkpoint would run on a plain ``pickle.load``."""

    def __init__(self, fn, *args) -> None:  # noqa: ANN001
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple:
        return self.fn, self.args


def _qualified(fn) -> str:  # noqa: ANN001
    return f"{fn.__module__}.{fn.__qualname__}"


def _payloads(marker: str) -> dict[str, tuple[_Payload, str]]:
    """name -> (payload that creates ``marker``, the global the refusal must name)."""
    return {
        "open": (_Payload(builtins.open, marker, "w"), "io.open"),
        "exec": (_Payload(builtins.exec, f"open({marker!r}, 'w').close()"), "builtins.exec"),
        "system": (_Payload(os.system, f"touch {marker}"), f"{os.system.__module__}.system"),
        # An allowed class's attribute, by dotted name (protocol 4 resolves it piece by piece).
        "path_touch": (
            _Payload(pathlib.Path.touch, pathlib.PosixPath(marker)),
            _qualified(pathlib.Path.touch),
        ),
    }


def _restamp(step: str, *names: str) -> None:
    """Record the current size and CRC32 of ``names`` in the marker, as a forger would."""
    path = os.path.join(step, MARKER)
    with open(path, encoding="utf-8") as f:
        info = json.load(f)
    for name in names:
        info["files"][name] = os.path.getsize(os.path.join(step, name))
        info["crc32"][name] = file_crc32(os.path.join(step, name))
    with open(path, "w", encoding="utf-8") as f:
        json.dump(info, f)


def _craft_metadata(step: str, payload: _Payload) -> None:
    """Replace ``step``'s .metadata by the real metadata with ``payload`` inside it."""
    metadata = CheckpointReader(step).read_metadata()
    # Deep inside, after the real classes: the unpickler meets it mid-way through the file.
    metadata.planner_data = {"mappings": metadata.planner_data, "x": payload}
    with open(os.path.join(step, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    _restamp(step, ".metadata")


def _craft_bytes_entry(step: str, key: str, payload: _Payload) -> str:
    """Point bytes entry ``key`` at a ``torch.save`` of ``payload`` appended to its data file."""
    metadata = CheckpointReader(step).read_metadata()
    index = next(i for i in metadata.storage_data if i.fqn == key)
    info = metadata.storage_data[index]
    blob = io.BytesIO()
    torch.save(payload, blob)
    data_file = os.path.join(step, info.relative_path)
    offset = os.path.getsize(data_file)
    with open(data_file, "ab") as f:
        f.write(blob.getvalue())
    metadata.storage_data[index] = type(info)(info.relative_path, offset, len(blob.getvalue()))
    with open(os.path.join(step, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    _restamp(step, ".metadata", info.relative_path)
    return data_file


def _copy_run(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return os.path.join(dst, "checkpoints", "step-2")


def _metadata_message(step: str, cls: str) -> str:
    return f"{os.path.join(step, '.metadata')}: refusing to unpickle '{cls}': not a DCP metadata class"


# -- unit tests: no processes --------------------------------------------------------------


def _synthetic_checkpoint(path: str) -> str:
    """A tiny real DCP checkpoint (one tensor, one bytes entry), written in this process."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"model.w": torch.arange(6.0).reshape(2, 3), "train_state.step": 7},
            checkpoint_id=path,
            no_dist=True,
        )
    return path


@pytest.mark.parametrize("kind", ["open", "exec", "system", "path_touch"])
def test_crafted_metadata_is_refused_before_anything_is_built(tmp_path, kind: str) -> None:
    step = _synthetic_checkpoint(str(tmp_path / "ckpt"))
    marker = str(tmp_path / "PWNED")
    payload, cls = _payloads(marker)[kind]
    metadata = CheckpointReader(step).read_metadata()
    metadata.planner_data = payload
    with open(os.path.join(step, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(UnsafeCheckpointError) as err:
        read_metadata(step)
    assert _metadata_message(step, cls) in str(err.value), str(err.value)
    assert "Only load checkpoints you trust" in str(err.value) and "safetensors" in str(err.value)
    assert not os.path.exists(marker)
    # Positive control: torch's own reader (plain pickle.load) runs the payload.
    FileSystemReader(step).read_metadata()
    assert os.path.exists(marker), f"the {kind} payload does nothing: the refusal above proves nothing"


def _craft_bytes_entry_plain(step: str, key: str, payload: _Payload) -> str:
    """``_craft_bytes_entry`` for a folder without a meshwright marker."""
    with open(os.path.join(step, MARKER), "w", encoding="utf-8") as f:
        json.dump({"files": {}, "crc32": {}}, f)
    return _craft_bytes_entry(step, key, payload)


def test_crafted_bytes_entry_is_refused(tmp_path) -> None:
    step = _synthetic_checkpoint(str(tmp_path / "ckpt"))
    marker = str(tmp_path / "PWNED")
    data_file = _craft_bytes_entry_plain(step, "train_state.step", _Payload(builtins.open, marker, "w"))
    state = {"train_state.step": 0}
    with pytest.raises(UnsafeCheckpointError) as err:
        dcp_load(state, step, no_dist=True)
    assert f"{data_file}: refusing to unpickle bytes entry 'train_state.step': 'io.open'" in str(err.value)
    assert not os.path.exists(marker) and state == {"train_state.step": 0}
    # Positive control: DCP's default planner (torch.load(weights_only=False)) runs it.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"train_state.step": 0}, storage_reader=FileSystemReader(step), no_dist=True)
    assert os.path.exists(marker)


def test_reader_rejects_the_default_planner_and_foreign_file_names(tmp_path) -> None:
    step = _synthetic_checkpoint(str(tmp_path / "ckpt"))
    with pytest.raises(CheckpointException, match="needs planner=SafeLoadPlanner"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"train_state.step": 0}, storage_reader=CheckpointReader(step), no_dist=True)
    state = {"model.w": torch.zeros(2, 3), "train_state.step": 0}
    dcp_load(state, step, no_dist=True)
    assert state["train_state.step"] == 7 and torch.equal(state["model.w"], torch.arange(6.0).reshape(2, 3))
    # A data file outside the folder (a path, not a file name) is refused too.
    metadata = CheckpointReader(step).read_metadata()
    index = next(iter(metadata.storage_data))
    info = metadata.storage_data[index]
    metadata.storage_data[index] = type(info)("../elsewhere/__0_0.distcp", info.offset, info.length)
    with open(os.path.join(step, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(UnsafeCheckpointError, match="names data file '../elsewhere/__0_0.distcp'"):
        read_metadata(step)
    # Garbage is still reported as corruption, not as an attack.
    with open(os.path.join(step, ".metadata"), "wb") as f:
        f.write(b"\x00garbage" * 8)
    with pytest.raises(ConfigError, match="cannot be read .* the checkpoint is corrupt"):
        read_metadata(step)


def test_allow_list_is_exactly_the_dcp_metadata_globals() -> None:
    allowed = metadata_globals()
    modules = {m for m, _ in allowed}
    assert modules == {
        "torch.distributed.checkpoint.metadata",
        "torch.distributed.checkpoint.filesystem",
        "torch",
        "torch.serialization",
        "pathlib",
        "pathlib._local",
    }
    assert ("torch.serialization", "_get_layout") in allowed and ("torch", "Size") in allowed
    others = {n for m, n in allowed if m == "torch" and n != "Size"}
    assert {"float32", "bfloat16", "uint8"} <= others
    assert all(isinstance(allowed[("torch", n)], torch.dtype) for n in others)
    assert not any(n in ("getattr", "eval", "exec", "system", "open", "load") for _, n in allowed)


# -- the product holds no other unsafe deserialization --------------------------------------

PRODUCT = ("trainer", "models", "parallelisms", "benchmarks")
# (file, what) -> why it is safe.
ALLOWED_DESERIALIZATION = {
    ("trainer/checkpoint/reader.py", "pickle.Unpickler"): "the base of the allow-list unpickler of DCP "
    ".metadata (find_class resolves only metadata_globals())",
    ("trainer/checkpoint/footprint.py", "pickle.loads"): "the rehearsal's round trip of save plans it has "
    "just built in this process (pickle.loads(pickle.dumps(obj)), as a peer receives them): no file, no "
    "peer's bytes",
}
_UNSAFE_ATTRS = {
    ("pickle", "load"),
    ("pickle", "loads"),
    ("pickle", "Unpickler"),
    ("_pickle", "load"),
    ("_pickle", "loads"),
    ("_pickle", "Unpickler"),
    ("marshal", "load"),
    ("marshal", "loads"),
    ("shelve", "open"),
    ("dill", "load"),
    ("dill", "loads"),
    ("cloudpickle", "load"),
    ("cloudpickle", "loads"),
    ("yaml", "load"),
    ("yaml", "unsafe_load"),
    ("yaml", "full_load"),
    ("yaml", "load_all"),
    ("yaml", "Loader"),
    ("yaml", "UnsafeLoader"),
    ("yaml", "FullLoader"),
    ("joblib", "load"),
}


def _unsafe_uses(rel: str, source: str) -> list[tuple[str, int, str]]:
    """(file, line, what) of each unsafe deserialization in one product file."""
    found = []
    for node in ast.walk(ast.parse(source)):
        what = None
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id, node.attr) in _UNSAFE_ATTRS:
                what = f"{node.value.id}.{node.attr}"
        elif isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names if (node.module, a.name) in _UNSAFE_ATTRS]
            if names:
                what = f"from {node.module} import {', '.join(names)}"
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            owner = (
                func.value.id
                if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
                else None
            )
            kw = {k.arg: k.value for k in node.keywords}
            if owner == "torch" and name == "load":
                safe = kw.get("weights_only")
                if not (isinstance(safe, ast.Constant) and safe.value is True):
                    what = "torch.load without weights_only=True"
            elif owner in ("np", "numpy") and name == "load" and "allow_pickle" in kw:
                if not (isinstance(kw["allow_pickle"], ast.Constant) and kw["allow_pickle"].value is False):
                    what = "np.load with allow_pickle"
            elif isinstance(func, ast.Name) and name in ("eval", "exec"):
                what = f"{name}()"
            elif "trust_remote_code" in kw:
                what = "trust_remote_code="
        if what is not None:
            found.append((rel, node.lineno, what))
    return found


def test_no_unsafe_deserialization_in_the_product() -> None:
    seen, unexpected = set(), []
    for top in PRODUCT:
        for root, _, files in os.walk(os.path.join(REPO, top)):
            for name in sorted(files):
                if not name.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(root, name), REPO)
                with open(os.path.join(root, name), encoding="utf-8") as f:
                    for file, line, what in _unsafe_uses(rel, f.read()):
                        if (file, what) in ALLOWED_DESERIALIZATION:
                            seen.add((file, what))
                        else:
                            unexpected.append(f"{file}:{line}: {what}")
    assert not unexpected, (
        "unsafe deserialization of possibly untrusted data (use torch.load(weights_only=True), JSON, "
        "safetensors, or trainer.checkpoint.reader; or add it to ALLOWED_DESERIALIZATION with the reason):\n"
        + "\n".join(unexpected)
    )
    assert seen == set(ALLOWED_DESERIALIZATION), (
        f"stale allow-list entries: {set(ALLOWED_DESERIALIZATION) - seen}"
    )


def test_the_product_scan_catches_each_pattern() -> None:
    source = (
        "import pickle, torch, yaml, numpy as np\nfrom dill import loads\n"
        "pickle.load(f)\ntorch.load(p)\ntorch.load(p, weights_only=False)\nyaml.load(s)\n"
        "np.load(p, allow_pickle=True)\neval(s)\nx.from_pretrained(p, trust_remote_code=True)\n"
        "torch.load(p, weights_only=True)\nnp.load(p)\nyaml.safe_load(s)\n"
    )
    whats = [what for _, _, what in _unsafe_uses("x.py", source)]
    assert whats.count("torch.load without weights_only=True") == 2 and len(whats) == 8, whats


# -- every entry point, on real checkpoints ---------------------------------------------------


def _train(rank: int, world_size: int, cfgs: list) -> None:
    from trainer.train import Trainer

    for cfg in cfgs:
        trainer = Trainer(cfg)
        trainer.train()
        trainer.close()


def _resume_errors(rank: int, world_size: int, cfgs: dict) -> dict[str, str]:
    """Construct a Trainer on each config (it resumes from its run folder); the ConfigError raised."""
    from trainer.train import Trainer

    errors = {}
    for name, cfg in cfgs.items():
        try:
            Trainer(cfg).close()
            errors[name] = "no error"
        except ConfigError as e:
            errors[name] = str(e)
    return errors


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Real checkpoints: ``run`` (one process, sync, with a comm ledger for ``plan --run``),
    ``async`` (step 1 written in the background) and ``fsdp`` (2 ranks, sharded)."""
    tmp = str(tmp_path_factory.mktemp("safe_load"))
    run_distributed(
        _train,
        1,
        [
            tiny_config(os.path.join(tmp, "run"), *RUN, "checkpoint.interval=2", "metrics.comm_ledger=true"),
            tiny_config(
                os.path.join(tmp, "async"), *RUN, "checkpoint.async_mode=async", "checkpoint.interval=1"
            ),
        ],
    )
    run_distributed(_train, 2, [tiny_config(os.path.join(tmp, "fsdp"), *RUN, "checkpoint.interval=2", *FSDP)])
    return tmp


@pytest.mark.slow
def test_real_checkpoints_load_through_the_allow_list(written: str) -> None:
    """Sync, async and FSDP-sharded checkpoints of the current torch: the same metadata as torch's
    reader, and every tensor and every bytes entry loads."""
    for run, step in (("run", 2), ("async", 1), ("async", 2), ("fsdp", 2)):
        path = os.path.join(written, run, "checkpoints", f"step-{step}")
        ours, theirs = CheckpointReader(path).read_metadata(), FileSystemReader(path).read_metadata()
        assert (
            ours.state_dict_metadata == theirs.state_dict_metadata
            and ours.storage_data == theirs.storage_data
        )
        assert ours.planner_data == theirs.planner_data and ours.storage_meta.load_id is not None
        tensors = load_full_state(path, "")
        assert any(k.startswith("optimizer.state.") for k in tensors) and len(tensors) > 100
        entries = {
            k: None for k, v in ours.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)
        }
        dcp_load(entries, path, no_dist=True)
        assert entries["train_state.step"] == step and entries["dataloader.samples_seen"] == 8 * step, run
        assert isinstance(entries["lr_scheduler.base_lrs"], list) and None not in entries.values()


def _cli(*args: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.Popen(
        [sys.executable, *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _craft_all(written: str, tmp: str) -> dict[str, str]:
    """Crafted copies of the written runs; each payload would create its own ``PWNED-*`` file."""
    evil = _copy_run(os.path.join(written, "run"), os.path.join(tmp, "evil_run"))
    _craft_metadata(evil, _Payload(builtins.open, os.path.join(tmp, "PWNED-cli"), "w"))
    evil_fsdp = _copy_run(os.path.join(written, "fsdp"), os.path.join(tmp, "evil_fsdp"))
    _craft_metadata(evil_fsdp, _Payload(os.system, f"touch {os.path.join(tmp, 'PWNED-resume')}"))
    evil_bytes = _copy_run(os.path.join(written, "fsdp"), os.path.join(tmp, "evil_bytes"))
    payload = _Payload(builtins.open, os.path.join(tmp, "PWNED-bytes"), "w")
    bytes_file = _craft_bytes_entry(evil_bytes, "train_state.step", payload)
    evil_yaml = os.path.join(tmp, "evil_yaml")
    shutil.copytree(os.path.join(written, "run"), evil_yaml)
    with open(os.path.join(evil_yaml, "config.yaml"), "w", encoding="utf-8") as f:
        f.write(f'model: !!python/object/apply:builtins.open ["{os.path.join(tmp, "PWNED-yaml")}", "w"]\n')
    return {
        "evil": evil,
        "evil_fsdp": evil_fsdp,
        "evil_bytes": evil_bytes,
        "bytes_file": bytes_file,
        "evil_yaml": evil_yaml,
        "hf_out": os.path.join(tmp, "hf"),
    }


def _run_folder(step: str) -> str:
    return os.path.dirname(os.path.dirname(step))


@pytest.fixture(scope="module")
def outcomes(written: str) -> dict:
    """Every entry point on the crafted checkpoints: the CLIs as concurrent subprocesses (exit
    status, stdout, stderr) and, meanwhile, Trainers on 2 FSDP ranks (the ConfigError per rank)."""
    tmp = os.path.join(written, "crafted")
    os.makedirs(tmp)
    paths = _craft_all(written, tmp)
    evil = paths["evil"]
    clis = {
        "initial_load_path": _cli(
            "trainer/main.py",
            *TINY,
            "training.steps=2",
            f"job.dump_folder={tmp}/fresh",
            f"checkpoint.initial_load_path={evil}",
        ),
        "generate": _cli("-m", "trainer.generate", evil, "--max-new-tokens", "2"),
        "export_hf": _cli("-m", "trainer.export_hf", evil, paths["hf_out"]),
        "plan_run": _cli(
            "-m", "trainer.plan", f"--run={_run_folder(evil)}", "cluster.gpus_per_node=1", "cluster.nodes=1"
        ),
        "plan_run_yaml": _cli("-m", "trainer.plan", f"--run={paths['evil_yaml']}"),
    }
    cfgs = {  # checkpoint.enable=true: each resumes from the newest step of its run folder
        "resume_metadata": tiny_config(_run_folder(paths["evil_fsdp"]), *RUN, *FSDP),
        "resume_bytes": tiny_config(_run_folder(paths["evil_bytes"]), *RUN, *FSDP),
        "model_only": tiny_config(
            os.path.join(tmp, "model_only"),
            "training.steps=2",
            *FSDP,
            f"checkpoint.initial_load_path={paths['evil_bytes']}",
        ),
    }
    per_rank = run_distributed(_resume_errors, 2, cfgs)
    done = {name: (p.communicate(timeout=240), p.returncode) for name, p in clis.items()}
    pwned = sorted(name for name in os.listdir(tmp) if name.startswith("PWNED"))
    return {
        "paths": paths,
        "per_rank": per_rank,
        "pwned": pwned,
        "cli": {name: (rc, out, err) for name, ((out, err), rc) in done.items()},
    }


def _assert_clean_refusal(result: tuple[int, str, str], refusal: str) -> None:
    rc, out, err = result
    assert rc == 2 and refusal in err and "Traceback" not in out + err, (rc, out[-2000:], err[-3000:])
    assert "Only load checkpoints you trust" in err and "safetensors" in err


@pytest.mark.slow
def test_training_start_refuses_crafted_metadata(outcomes: dict) -> None:
    """``python trainer/main.py checkpoint.initial_load_path=<crafted step>``: exit 2, no traceback."""
    evil = outcomes["paths"]["evil"]
    _assert_clean_refusal(outcomes["cli"]["initial_load_path"], _metadata_message(evil, "io.open"))
    assert outcomes["pwned"] == []


@pytest.mark.slow
def test_resume_refuses_crafted_metadata_and_bytes_entry_on_every_rank(outcomes: dict) -> None:
    per_rank, paths = outcomes["per_rank"], outcomes["paths"]
    assert per_rank[0] == per_rank[1], per_rank  # every rank refuses, with the same message
    errors = per_rank[0]
    want = _metadata_message(paths["evil_fsdp"], f"{os.system.__module__}.system")
    assert want in errors["resume_metadata"], errors
    want = (
        f"{paths['bytes_file']}: refusing to unpickle bytes entry 'train_state.step': "
        "'io.open' is not an allowed"
    )
    assert want in errors["resume_bytes"], errors
    # A model-only start reads no bytes entry: the weights of that checkpoint are intact and load.
    assert errors["model_only"] == "no error", errors
    assert outcomes["pwned"] == []


@pytest.mark.slow
def test_generate_and_export_refuse_crafted_metadata(outcomes: dict) -> None:
    refusal = _metadata_message(outcomes["paths"]["evil"], "io.open")
    _assert_clean_refusal(outcomes["cli"]["generate"], refusal)
    _assert_clean_refusal(outcomes["cli"]["export_hf"], refusal)
    assert not os.path.exists(outcomes["paths"]["hf_out"]) and outcomes["pwned"] == []


@pytest.mark.slow
def test_plan_run_reads_no_checkpoint_and_only_safe_yaml(outcomes: dict) -> None:
    """``trainer.plan --run`` reads config.yaml (OmegaConf: a yaml SafeLoader) and metrics.jsonl,
    never the checkpoints: it succeeds on the run folder holding the crafted checkpoint."""
    rc, out, err = outcomes["cli"]["plan_run"]
    assert rc == 0 and "planned vs measured" in out, (rc, out[-2000:], err[-3000:])
    rc, out, err = outcomes["cli"]["plan_run_yaml"]
    assert rc == 2 and "is not a plain YAML run config" in err and "Traceback" not in out + err, (
        rc,
        err[-3000:],
    )
    assert outcomes["pwned"] == []


@pytest.mark.slow
def test_the_crafted_payloads_work_on_torchs_own_reader(outcomes: dict) -> None:
    """Positive control (after every entry point ran): torch's FileSystemReader runs the payload."""
    FileSystemReader(outcomes["paths"]["evil"]).read_metadata()
    assert os.path.exists(os.path.join(_run_folder(outcomes["paths"]["evil"]), "..", "PWNED-cli"))
