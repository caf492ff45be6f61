"""Exported Hugging Face folders are usable by the ecosystem: ``AutoTokenizer`` loads the tokenizer
with our ids (byte-level included) and ``pipeline("text-generation")`` decodes the same greedy
tokens as ``trainer.generate``. Everything is local; nothing is downloaded."""

from __future__ import annotations

import json
import os

import pytest

from tests.configs import make_config
from trainer.data.documents import load_documents
from trainer.data.tokenizer import ByteTokenizer, HFTokenizer

transformers = pytest.importorskip("transformers", reason="transformers (the dev extra) is not installed")


def _validation_documents(n: int) -> list[str]:
    return load_documents(make_config("data=builtin").data, "validation")[:n]


def test_byte_tokenizer_export_loads_in_autotokenizer_with_our_ids(debug_run) -> None:
    ours = ByteTokenizer()
    docs = _validation_documents(12)
    assert sum(len(d) for d in docs) > 100_000 and any(not d.isascii() for d in docs + ["é"])
    docs.append("non-ASCII é ü 漢字 🎉, a literal <|end_of_text|> and <|begin_of_text|> stay bytes\n")
    for folder in (debug_run.hf_from_run, debug_run.hf_exported):
        names = set(os.listdir(folder))
        assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"} <= names
        tok = transformers.AutoTokenizer.from_pretrained(folder)
        assert (tok.bos_token_id, tok.eos_token_id, len(tok)) == (ours.bos_id, ours.eos_id, ours.vocab_size)
        n_tokens = 0
        for doc in docs:
            ids = ours.encode(doc)
            assert tok(doc, add_special_tokens=False).input_ids == ids
            assert tok(doc).input_ids == [ours.bos_id, *ids]  # BOS first, as our data and generate do
            assert tok.decode([ours.bos_id, *ids, ours.eos_id], skip_special_tokens=True) == ours.decode(ids)
            n_tokens += len(ids)
        generation = json.load(open(os.path.join(folder, "generation_config.json")))
        assert (generation["bos_token_id"], generation["eos_token_id"]) == (ours.bos_id, ours.eos_id)
        print(
            f"{os.path.basename(folder)}: AutoTokenizer == ByteTokenizer on {len(docs)} documents, "
            f"{n_tokens} ids"
        )


def test_pipeline_greedy_tokens_equal_trainer_generate(debug_run) -> None:
    from models.generation import generate
    from trainer.checkpoint.load import load_model

    model, tokenizer = load_model(debug_run.checkpoint)
    prompts = ["def main(", "import os\n", "class Foo:\n    def __init__(self"]
    for folder in (debug_run.hf_from_run, debug_run.hf_exported):
        pipe = transformers.pipeline("text-generation", model=folder, device="cpu")
        for prompt in prompts:
            prompt_ids = [tokenizer.bos_id, *tokenizer.encode(prompt)]
            want = generate(model, prompt_ids, max_new_tokens=32, temperature=0, eos_id=tokenizer.eos_id)
            out = pipe(prompt, do_sample=False, max_new_tokens=32, return_tensors=True)[0][
                "generated_token_ids"
            ]
            assert list(out) == want, (folder, prompt)
            text = pipe(prompt, do_sample=False, max_new_tokens=32, return_full_text=False)[0][
                "generated_text"
            ]
            assert text == tokenizer.decode(want[len(prompt_ids) :])
    print(f"pipeline greedy tokens == trainer.generate on {len(prompts)} prompts x 2 folders (32 new tokens)")


def test_hf_tokenizer_run_ships_its_files(tmp_path) -> None:
    """A run with a HF tokenizer.json: the export ships it (and its side files), AutoTokenizer agrees."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from trainer.checkpoint.hf_tokenizer import write_tokenizer_files

    docs = _validation_documents(6)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(
        docs,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    src = tmp_path / "tok"
    src.mkdir()
    bpe.save(str(src / "tokenizer.json"))
    out = tmp_path / "hf"
    out.mkdir()
    files = write_tokenizer_files(str(out), str(src / "tokenizer.json"), max_len=512)
    assert set(files) == {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    ours = HFTokenizer(str(src / "tokenizer.json"))
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert (tok.bos_token_id, tok.eos_token_id) == (ours.bos_id, ours.eos_id)
    for doc in docs:
        assert tok(doc, add_special_tokens=False).input_ids == ours.encode(doc)
