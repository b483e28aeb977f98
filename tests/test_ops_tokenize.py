"""Tests for ``tokenize`` and ``tokenize_chat`` with real tokenizers trained at fixture time."""

from __future__ import annotations

import itertools
import json
import multiprocessing
import pickle
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
from contract_registry import ContractData, cases_for, check_case
from fixtures_tokenizer import SPECIAL_TOKENS, train_test_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from zephon_torch.ops.accumulators import CountingAccumulator
from zephon_torch.ops.base import TOMBSTONE_REASON_TAG, OpContext, tombstone
from zephon_torch.ops.chat_templates import DEFAULT_CHAT_TEMPLATE
from zephon_torch.ops.tokenize import Tokenize
from zephon_torch.ops.tokenize_chat import TokenizeChat
from zephon_torch.ops.tokenizer_loading import BOS_TOKEN_CANDIDATES, EOS_TOKEN_CANDIDATES
from zephon_torch.types import FLUSH_SENTINEL_TAG, SampleBatch, SampleMeta, SampleRecord

EOT, BOS = 0, 1  # "<|endoftext|>" and "<s>" in the test tokenizer
TEXTS = ["Hello world, the lane 42!", "", "kazo phelin tra", "ünïcødé ✓ 日本語", "  spaced  "]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train_test_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture
def tok(trained):
    """A private copy: some tests change the tokenizer's settings."""
    return Tokenizer.from_str(trained[0].to_str())


@pytest.fixture
def tok_path(trained):
    return trained[1]


@pytest.fixture
def bare_tok(tmp_path):
    """A tokenizer with no special tokens at all (a fresh one per test)."""
    return train_test_tokenizer(tmp_path / "bare", special_tokens=())[0]


def _rec(i: int, payload, *, lane: int = 0) -> SampleRecord:
    meta = SampleMeta(sample_id=(0, 3, i), lane_id=lane, chunk_id=1, chunk_offset=i)
    return SampleRecord(meta, payload)


def _texts(texts, field: str = "text") -> list[SampleRecord]:
    return [_rec(i, {field: t, "keep": i}) for i, t in enumerate(texts)]


def _enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def _flush_sentinel() -> SampleRecord:
    meta = SampleMeta(sample_id=(-1, -1, -1), lane_id=0, chunk_id=9,
                      tags={FLUSH_SENTINEL_TAG: True})
    return SampleRecord(meta, None)


# --------------------------------------------------------------------------- the fixture


def test_fixture_tokenizer_is_deterministic_and_has_the_special_tokens(tmp_path, tok):
    again, path = train_test_tokenizer(tmp_path)
    assert again.to_str() == tok.to_str()
    assert path.name == "tokenizer.json" and path.is_file()
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert 512 <= tok.get_vocab_size() <= 1024


# --------------------------------------------------------------------------- tokenize


@pytest.mark.parametrize(
    ("mode", "prefix", "suffix"),
    [("bos_eos", [BOS], [EOT]), ("eos", [], [EOT]), ("bos", [BOS], []), ("none", [], [])],
)
def test_ids_are_the_tokenizer_ids_plus_requested_specials(tok, mode, prefix, suffix):
    recs = _texts(TEXTS)
    out = Tokenize(tok, special_tokens=mode).process_many(recs)
    for rec, res, text in zip(recs, out, TEXTS, strict=True):
        ids = res.payload["input_ids"]
        assert isinstance(ids, np.ndarray) and ids.dtype == np.int32 and ids.ndim == 1
        assert ids.tolist() == prefix + _enc(tok, text) + suffix
        assert res.meta is rec.meta
        assert res.payload["text"] == text and res.payload["keep"] == rec.payload["keep"]
        assert "input_ids" not in rec.payload  # shallow copy, input untouched


def test_special_ids_are_found_in_the_tokenizer(tok):
    op = Tokenize(tok, special_tokens="bos_eos")
    assert (op.bos_token_id, op.eos_token_id) == (BOS, EOT)
    assert (EOS_TOKEN_CANDIDATES[0], BOS_TOKEN_CANDIDATES[0]) == ("<|endoftext|>", "<s>")
    op = Tokenize(tok, special_tokens="bos_eos", bos_token_id=2, eos_token_id=3)
    assert (op.bos_token_id, op.eos_token_id) == (2, 3)
    (res,) = op.process_many(_texts(["the fox"]))
    assert res.payload["input_ids"].tolist() == [2, *_enc(tok, "the fox"), 3]


def test_lookup_order_prefers_earlier_candidates(bare_tok):
    # "</s>" is the second EOS candidate, "<|endoftext|>" the last BOS candidate.
    bare_tok.add_special_tokens(["</s>", "<|endoftext|>"])
    op = Tokenize(bare_tok, special_tokens="bos_eos")
    assert op.eos_token_id == bare_tok.token_to_id("<|endoftext|>")
    assert op.bos_token_id == bare_tok.token_to_id("<|endoftext|>")
    bare_tok.add_special_tokens(["<s>"])
    assert Tokenize(bare_tok, special_tokens="bos").bos_token_id == bare_tok.token_to_id("<s>")


def test_missing_special_tokens_raise_a_clear_error(bare_tok):
    with pytest.raises(ValueError, match="bos_token_id") as err:
        Tokenize(bare_tok, special_tokens="bos_eos")  # both are missing: one message names both
    assert "eos_token_id" in str(err.value)
    assert all(t in str(err.value) for t in (*BOS_TOKEN_CANDIDATES, *EOS_TOKEN_CANDIDATES))
    with pytest.raises(ValueError, match=r"EOS.*'<\|endoftext\|>'.*eos_token_id"):
        Tokenize(bare_tok, special_tokens="eos")
    with pytest.raises(ValueError, match=r"BOS.*'<s>'.*bos_token_id"):
        Tokenize(bare_tok, special_tokens="bos")
    # Nothing needed, nothing looked up; explicit ids always work.
    assert Tokenize(bare_tok, special_tokens="none").eos_token_id is None
    op = Tokenize(bare_tok, special_tokens="bos_eos", bos_token_id=5, eos_token_id=6)
    assert (op.bos_token_id, op.eos_token_id) == (5, 6)


@pytest.mark.parametrize("mode", ["both", "BOS_EOS", "", None])
def test_unknown_special_tokens_mode_is_rejected(tok, mode):
    with pytest.raises(ValueError, match="special_tokens"):
        Tokenize(tok, special_tokens=mode)


@pytest.mark.parametrize("bad", [-1, 10**9, 1.0, True, "0"])
def test_explicit_special_ids_are_validated(tok, bad):
    with pytest.raises(ValueError, match="eos_token_id"):
        Tokenize(tok, eos_token_id=bad)


def test_max_length_truncates_and_keeps_eos_last(tok):
    text = "the quick brown fox jumps over the lazy dog"
    body = _enc(tok, text)
    assert len(body) > 6
    recs = _texts([text, "fox"])
    out = Tokenize(tok, special_tokens="bos_eos", max_length=6).process_many(recs)
    assert out[0].payload["input_ids"].tolist() == [BOS, *body[:4], EOT]
    assert out[1].payload["input_ids"].tolist() == [BOS, *_enc(tok, "fox"), EOT]
    (res,) = Tokenize(tok, special_tokens="eos", max_length=3).process_many(recs[:1])
    assert res.payload["input_ids"].tolist() == [*body[:2], EOT]
    (res,) = Tokenize(tok, special_tokens="bos", max_length=3).process_many(recs[:1])
    assert res.payload["input_ids"].tolist() == [BOS, *body[:2]]
    (res,) = Tokenize(tok, special_tokens="none", max_length=3).process_many(recs[:1])
    assert res.payload["input_ids"].tolist() == body[:3]
    (res,) = Tokenize(tok, special_tokens="bos_eos", max_length=2).process_many(recs[:1])
    assert res.payload["input_ids"].tolist() == [BOS, EOT]
    assert res.payload["input_ids"].dtype == np.int32


@pytest.mark.parametrize(("mode", "bad"), [("bos_eos", 1), ("eos", 0), ("none", 0),
                                           ("none", -3), ("none", 2.5)])
def test_max_length_must_leave_room_for_special_tokens(tok, mode, bad):
    with pytest.raises(ValueError, match="max_length"):
        Tokenize(tok, special_tokens=mode, max_length=bad)


def test_path_inputs_match_the_tokenizer_object(tok, tok_path):
    recs = _texts(TEXTS)
    expected = Tokenize(tok).process_many(recs)
    for source in (tok_path, str(tok_path), tok_path.parent):
        op = Tokenize(source)
        assert op.process_many(recs) == expected
        assert op.config() == Tokenize(tok).config()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenize(tok_path.parent / "nope.json")
    with pytest.raises(TypeError, match="tokenizer must be"):
        Tokenize(object())


def test_a_transformers_tokenizer_gives_its_backend_and_its_own_special_ids(tok):
    transformers = pytest.importorskip("transformers")
    recs = _texts(TEXTS)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    assert Tokenize(fast).process_many(recs) == Tokenize(tok).process_many(recs)
    # Its own special tokens win over any look-up by name ("</s>" is id 2, "<pad>" 3).
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="</s>",
                                                eos_token="<pad>", pad_token="<s>")
    op = Tokenize(fast, special_tokens="bos_eos")
    assert (op.bos_token_id, op.eos_token_id, op.pad_token_id) == (2, 3, BOS)
    assert "eos_token_id" in op.special_token_sources["eos"]
    assert Tokenize(fast, eos_token_id=0).eos_token_id == 0  # the argument wins


def test_a_transformers_tokenizer_without_eos_is_an_error_not_a_guess(tok):
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok)
    # "<|endoftext|>" is in the vocabulary, but the tokenizer does not call it its EOS.
    # (transformers 5 calls the class TokenizersBackend, 4.x PreTrainedTokenizerFast)
    with pytest.raises(ValueError, match=r"the transformers tokenizer \(\w+\) "
                                         r"does not name: no EOS token \(.*names no eos_token; "
                                         r"token names are not guessed\); pass eos_token_id="):
        Tokenize(fast)
    assert Tokenize(fast, eos_token_id=EOT).eos_token_id == EOT


def test_tokenizer_padding_and_truncation_settings_are_ignored(tok, trained):
    # Padding to the longest text of a micro-batch would make a sample's ids
    # depend on its neighbours; the operator switches it off.
    tok.enable_padding(pad_id=3, pad_token="<pad>", length=None)
    tok.enable_truncation(max_length=2)
    out = Tokenize(tok).process_many(_texts(TEXTS))
    for res, text in zip(out, TEXTS, strict=True):
        assert res.payload["input_ids"].tolist() == [*_enc(trained[0], text), EOT]
    assert tok.padding is not None  # the caller's tokenizer is left as it was


def test_custom_fields(tok):
    recs = [_rec(0, {"body": "the lane", "text": 123})]
    (res,) = Tokenize(tok, field="body", out_field="tokens").process_many(recs)
    assert res.payload["tokens"].tolist() == [*_enc(tok, "the lane"), EOT]
    assert res.payload["text"] == 123 and "input_ids" not in res.payload
    with pytest.raises(ValueError, match="out_field"):
        Tokenize(tok, out_field="")


def test_a_text_the_tokenizer_cannot_encode_fails_alone_naming_its_sample(tok):
    texts = ["the lane", "half an emoji \ud83d", "kazo phelin", "\udfff", "ünïcødé ✓"]
    recs = _texts(texts)
    with pytest.raises(ValueError) as err:
        Tokenize(tok).process_many(recs)
    assert str(err.value).startswith(
        "tokenize: sample (0, 3, 1) field 'text' holds a lone UTF-16 surrogate \\ud83d "
        "(character 14) (not valid Unicode"), str(err.value)
    assert isinstance(err.value.__cause__, Exception)  # what the tokenizer raised
    whole = Tokenize(tok, on_error="skip").process_many(recs)
    assert [r.meta.tags.get(TOMBSTONE_REASON_TAG) for r in whole] == [
        None, "tokenize_error", None, "tokenize_error", None]
    for rec, text in zip(whole, texts):
        if rec.payload is not None:  # the others are encoded exactly as on their own
            assert rec.payload["input_ids"].tolist() == [*_enc(tok, text), EOT]
    one_by_one = [r for rec in recs for r in Tokenize(tok, on_error="skip").process_many([rec])]
    assert one_by_one == whole


def test_a_chat_the_tokenizer_cannot_encode_fails_alone_naming_its_message(tok):
    bad = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x\ud800"}]
    recs = [_rec(0, {"messages": CONVO}), _rec(1, {"messages": bad}),
            _rec(2, {"messages": CONVO})]
    with pytest.raises(ValueError, match=r"^tokenize_chat: sample \(0, 3, 1\): the content of "
                                         r"message 1 \(assistant\) holds a lone UTF-16 "
                                         r"surrogate \\ud800 \(character 1\)"):
        TokenizeChat(tok).process_many(recs)
    out = TokenizeChat(tok, on_error="skip").process_many(recs)
    assert out[1].meta.tags[TOMBSTONE_REASON_TAG] == "tokenize_chat_error"
    alone = TokenizeChat(tok).process_many([recs[0]])[0].payload
    for rec in (out[0], out[2]):  # the neighbours come out as if tokenized on their own
        assert rec.payload["input_ids"].tolist() == alone["input_ids"].tolist()
        assert rec.payload["loss_mask"].tolist() == alone["loss_mask"].tolist()


@pytest.mark.parametrize(
    ("payload", "expected"),
    [({"other": "x"}, "has no field 'text'"), ({"text": 7}, "is a int, not a str"),
     ({"text": None}, "is a NoneType"), ("raw string", "payload is a str")],
)
def test_bad_text_raises_naming_sample_and_field_or_is_skipped(tok, payload, expected):
    recs = [_rec(0, {"text": "fine"}), _rec(1, payload), _rec(2, {"text": "also fine"})]
    with pytest.raises(ValueError, match=r"sample \(0, 3, 1\)") as err:
        Tokenize(tok).process_many(recs)
    assert expected in str(err.value) and "on_error='skip'" in str(err.value)
    out = Tokenize(tok, on_error="skip").process_many(recs)
    assert out[1].meta.tombstone and out[1].payload is None
    assert out[1].meta.tags[TOMBSTONE_REASON_TAG] == "tokenize_error"
    assert out[1].meta.cursor == recs[1].meta.cursor
    assert out[2].payload["input_ids"].tolist() == [*_enc(tok, "also fine"), EOT]
    with pytest.raises(ValueError, match="on_error"):
        Tokenize(tok, on_error="ignore")


@settings(max_examples=30, deadline=None)
@given(
    texts=st.lists(st.text(max_size=40), max_size=24),
    cuts=st.lists(st.integers(0, 24), max_size=4),
    mode=st.sampled_from(["bos_eos", "eos", "bos", "none"]),
    max_length=st.one_of(st.none(), st.integers(2, 12)),
)
def test_outputs_do_not_depend_on_micro_batch_boundaries(trained, texts, cuts, mode, max_length):
    tok = trained[0]
    op = Tokenize(tok, special_tokens=mode, max_length=max_length)
    recs = _texts(texts)
    recs.insert(len(recs) // 2, tombstone(_rec(99, {"text": "x"}), "earlier"))
    whole = op.process_many(recs)
    bounds = sorted({0, len(recs), *(c for c in cuts if c <= len(recs))})
    pieces = [o for a, b in itertools.pairwise(bounds) for o in op.process_many(recs[a:b])]
    assert pieces == whole
    # And each record equals what it gets when tokenized alone.
    assert [o for r in recs for o in op.process_one(r)] == whole


def test_pickle_round_trip_rebuilds_the_tokenizer(tok):
    op = Tokenize(tok, max_length=8)
    recs = _texts(TEXTS)
    expected = op.process_many(recs)  # builds and caches the tokenizer
    assert op.__getstate__()["_tok"] is None
    assert op._tok is not None  # getstate must not clear the live instance
    back = pickle.loads(pickle.dumps(op))
    assert back._tok is None
    assert back.process_many(recs) == expected
    assert back.config() == op.config()


def test_operator_runs_in_a_spawned_worker_process(tok):
    # What the process runner does: ship the operator to a fresh interpreter,
    # which rebuilds the tokenizer from its JSON on first use.
    op = Tokenize(tok, special_tokens="eos")
    recs = _texts(TEXTS)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        remote = pool.submit(op.process_many, recs).result(timeout=60)
    assert remote == op.process_many(recs)


def test_cloudpickle_round_trip(tok):
    cloudpickle = pytest.importorskip("cloudpickle")
    op = Tokenize(tok, special_tokens="eos")
    recs = _texts(TEXTS)
    back = cloudpickle.loads(cloudpickle.dumps(op))
    assert back.process_many(recs) == op.process_many(recs)


def test_config_is_json_and_tracks_the_tokenizer(tok, bare_tok):
    cfg = Tokenize(tok, max_length=9).config()
    assert json.loads(json.dumps(cfg)) == cfg
    assert cfg["op"].endswith("Tokenize")
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["max_length"]) == (None, EOT, 9)
    assert len(cfg["tokenizer_sha256"]) == 64
    other = Tokenize(bare_tok, eos_token_id=0, max_length=9).config()
    assert other["tokenizer_sha256"] != cfg["tokenizer_sha256"]
    assert Tokenize(tok, special_tokens="bos_eos").config() != Tokenize(tok).config()


# --------------------------------------------------------------------------- shared behaviour


@pytest.mark.parametrize("kind", ["tokenize", "chat"])
def test_tombstones_and_sentinels_pass_through_untouched(tok, kind):
    op = Tokenize(tok) if kind == "tokenize" else TokenizeChat(tok)
    dead = tombstone(_rec(0, {"text": "gone"}), "filter")
    sentinel = _flush_sentinel()
    out = op.process_many([dead, sentinel])
    assert out[0] is dead and out[1] is sentinel


@pytest.mark.parametrize("kind", ["tokenize", "chat"])
def test_operator_basics(tok, kind):
    op = Tokenize(tok) if kind == "tokenize" else TokenizeChat(tok)
    assert op.name == ("tokenize" if kind == "tokenize" else "tokenize_chat")
    assert op.default_microbatch_size == 512
    acc = op.accumulator(deterministic=True, ctx=OpContext(microbatch_size=5))
    assert isinstance(acc, CountingAccumulator)
    assert acc.max_batch == 5 and acc.max_latency_ms is None
    assert op.traits().preserves_cursor_order
    op.setup(OpContext())
    with pytest.raises(TypeError, match="before batch"):
        op.process_many([SampleBatch([_rec(0, {"text": "a"})])])
    assert op.process_many([]) == []


# --------------------------------------------------------------------------- tokenize_chat


CONVO = [
    {"role": "system", "content": "You are kazo."},
    {"role": "user", "content": "Hello world?"},
    {"role": "assistant", "content": "The quick brown fox."},
    {"role": "user", "content": "And the lane?"},
    {"role": "assistant", "content": "Lane 42, shard 7!"},
]


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """``(start, stop)`` of each run of ones."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def _expected_default(tok, messages, *, eos=True, bos=True):
    ids, mask = ([BOS], [0]) if bos else ([], [])
    for m in messages:
        is_asst = m["role"] == "assistant"
        for text, flag in ((f"<|{m['role']}|>\n", 0), (m["content"], int(is_asst))):
            part = _enc(tok, text)
            ids += part
            mask += [flag] * len(part)
        if is_asst and eos:
            ids.append(EOT)
            mask.append(1)
        part = _enc(tok, "\n")
        ids += part
        mask += [0] * len(part)
    return ids, mask


def test_chat_mask_is_one_exactly_on_assistant_tokens(tok):
    rec = _rec(0, {"messages": CONVO, "id": "c1"})
    (res,) = TokenizeChat(tok).process_many([rec])
    ids, mask = res.payload["input_ids"], res.payload["loss_mask"]
    assert ids.dtype == np.int32 and mask.dtype == np.uint8 and ids.shape == mask.shape
    exp_ids, exp_mask = _expected_default(tok, CONVO)
    assert ids.tolist() == exp_ids and mask.tolist() == exp_mask
    # Decoding each supervised span gives back one assistant reply and its EOS.
    spans = [tok.decode(ids[a:b].tolist(), skip_special_tokens=False) for a, b in _runs(mask)]
    assert spans == [m["content"] + "<|endoftext|>" for m in CONVO if m["role"] == "assistant"]
    unsupervised = tok.decode(ids[mask == 0].tolist(), skip_special_tokens=False)
    assert unsupervised.startswith("<s><|system|>\nYou are kazo.\n<|user|>\nHello world?\n")
    assert "quick" not in unsupervised and "Lane 42" not in unsupervised
    assert res.meta is rec.meta and res.payload["id"] == "c1"
    assert res.payload["messages"] is CONVO


def test_chat_loss_on_last_turn_only(tok):
    (res,) = TokenizeChat(tok, loss_on_last_turn_only=True).process_many([_rec(0, {
        "messages": CONVO})])
    ids, mask = res.payload["input_ids"], res.payload["loss_mask"]
    assert ids.tolist() == _expected_default(tok, CONVO)[0]
    (span,) = _runs(mask)
    assert tok.decode(ids[span[0]:span[1]].tolist(), skip_special_tokens=False) == \
        "Lane 42, shard 7!<|endoftext|>"


def test_chat_special_token_modes(tok):
    rec = _rec(0, {"messages": CONVO[1:3]})
    for mode, bos, eos in (("eos", False, True), ("bos", True, False), ("none", False, False)):
        (res,) = TokenizeChat(tok, special_tokens=mode).process_many([rec])
        exp_ids, exp_mask = _expected_default(tok, CONVO[1:3], bos=bos, eos=eos)
        assert res.payload["input_ids"].tolist() == exp_ids
        assert res.payload["loss_mask"].tolist() == exp_mask


def test_chat_empty_assistant_reply_supervises_its_eos_only(tok):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]
    (res,) = TokenizeChat(tok).process_many([_rec(0, {"messages": messages})])
    ids, mask = res.payload["input_ids"], res.payload["loss_mask"]
    assert ids[mask == 1].tolist() == [EOT]


def test_chat_without_assistant_turn_has_an_all_zero_mask(tok):
    (res,) = TokenizeChat(tok).process_many([_rec(0, {"messages": CONVO[:2]})])
    assert res.payload["loss_mask"].sum() == 0 and len(res.payload["input_ids"]) > 0


def test_chat_string_template(tok):
    template = "[{role}] {content} [/{role}]"
    (res,) = TokenizeChat(tok, chat_template=template, special_tokens="eos").process_many(
        [_rec(0, {"messages": CONVO[1:3]})])
    expected = (_enc(tok, "[user] ") + _enc(tok, "Hello world?") + _enc(tok, " [/user]")
                + _enc(tok, "[assistant] ") + _enc(tok, "The quick brown fox.") + [EOT]
                + _enc(tok, " [/assistant]"))
    assert res.payload["input_ids"].tolist() == expected
    ids, mask = res.payload["input_ids"], res.payload["loss_mask"]
    assert tok.decode(ids[mask == 1].tolist(), skip_special_tokens=False) == \
        "The quick brown fox.<|endoftext|>"
    assert DEFAULT_CHAT_TEMPLATE == "<|{role}|>\n{content}\n"


def _template(messages):
    """Assistant turns split over two segments; EOS comes after the run."""
    segs = []
    for m in messages:
        segs.append((f"{m['role']}: ", False))
        if m["role"] == "assistant":
            half = len(m["content"]) // 2
            segs += [(m["content"][:half], True), (m["content"][half:], True)]
        else:
            segs.append((m["content"], False))
        segs.append(("\n", False))
    return segs


def test_chat_callable_template_eos_after_each_assistant_run(tok):
    (res,) = TokenizeChat(tok, chat_template=_template).process_many(
        [_rec(0, {"messages": CONVO})])
    ids, mask = res.payload["input_ids"], res.payload["loss_mask"]
    replies = [m["content"] for m in CONVO if m["role"] == "assistant"]
    spans = [tok.decode(ids[a:b].tolist(), skip_special_tokens=False) for a, b in _runs(mask)]
    assert spans == [r + "<|endoftext|>" for r in replies]
    assert ids[0] == BOS and mask[0] == 0
    (res,) = TokenizeChat(tok, chat_template=_template, special_tokens="none").process_many(
        [_rec(0, {"messages": CONVO})])
    assert EOT not in res.payload["input_ids"].tolist()


def test_chat_template_validation(tok):
    with pytest.raises(ValueError, match="content"):
        TokenizeChat(tok, chat_template="<|{role}|> no placeholder")
    with pytest.raises(ValueError, match="content"):
        TokenizeChat(tok, chat_template="{content}{content}")
    with pytest.raises(TypeError, match="chat_template"):
        TokenizeChat(tok, chat_template=3)
    with pytest.raises(ValueError, match="assistant"):
        TokenizeChat(tok, roles=("user", "bot"))
    with pytest.raises(ValueError, match="differ"):
        TokenizeChat(tok, mask_field="input_ids")
    bad = TokenizeChat(tok, chat_template=lambda messages: ["just text"])
    with pytest.raises(ValueError, match="is_assistant"):
        bad.process_many([_rec(0, {"messages": CONVO})])


@pytest.mark.parametrize(
    ("messages", "expected"),
    [("not a list", "must be a list"),
     ([{"role": "user", "content": "x"}, "oops"], "message 1 must be a dict"),
     ([{"role": "robot", "content": "x"}], "role 'robot'"),
     ([{"role": "assistant"}], "message 0 \\(assistant\\) needs a str 'content'"),
     ([{"role": "user", "content": ["parts"]}], "needs a str 'content'")],
)
def test_chat_malformed_messages_raise_or_are_skipped(tok, messages, expected):
    recs = [_rec(0, {"messages": CONVO}), _rec(1, {"messages": messages})]
    with pytest.raises(ValueError, match=expected) as err:
        TokenizeChat(tok).process_many(recs)
    assert "(0, 3, 1)" in str(err.value)
    out = TokenizeChat(tok, on_error="skip").process_many(recs)
    assert out[1].meta.tags[TOMBSTONE_REASON_TAG] == "tokenize_chat_error"
    assert out[0].payload["loss_mask"].sum() > 0


def test_chat_missing_field_and_custom_roles(tok):
    with pytest.raises(ValueError, match="has no field 'messages'"):
        TokenizeChat(tok).process_many([_rec(0, {"text": "plain"})])
    op = TokenizeChat(tok, roles=("developer", "user", "assistant"))
    (res,) = op.process_many([_rec(0, {"messages": [{"role": "developer", "content": "x"}]})])
    assert res.payload["loss_mask"].sum() == 0


def test_chat_max_length_cuts_ids_and_mask_together(tok):
    rec = _rec(0, {"messages": CONVO})
    (full,) = TokenizeChat(tok).process_many([rec])
    (cut,) = TokenizeChat(tok, max_length=10).process_many([rec])
    assert cut.payload["input_ids"].tolist() == full.payload["input_ids"][:10].tolist()
    assert cut.payload["loss_mask"].tolist() == full.payload["loss_mask"][:10].tolist()
    with pytest.raises(ValueError, match="max_length"):
        TokenizeChat(tok, max_length=0)


def test_chat_micro_batch_boundaries_and_pickling(tok):
    convos = [CONVO[: k + 1] for k in range(len(CONVO))] + [CONVO[2:], CONVO[:1]]
    recs = [_rec(i, {"messages": c}) for i, c in enumerate(convos)]
    op = TokenizeChat(tok, chat_template=_template)
    whole = op.process_many(recs)
    assert [o for r in recs for o in op.process_one(r)] == whole
    assert op.process_many(recs[:3]) + op.process_many(recs[3:]) == whole
    back = pickle.loads(pickle.dumps(op))
    assert back._tok is None and back.process_many(recs) == whole
    assert back.config() == op.config()


def test_chat_config_tracks_the_template(tok):
    cfg = TokenizeChat(tok).config()
    assert json.loads(json.dumps(cfg)) == cfg
    assert cfg["chat_template"] == DEFAULT_CHAT_TEMPLATE
    with_fn = TokenizeChat(tok, chat_template=_template).config()
    assert with_fn["chat_template"]["name"].endswith("._template")
    assert TokenizeChat(tok, loss_on_last_turn_only=True).config() != cfg


def test_the_operators_keep_the_names_saved_fingerprints_hold(tok):
    # Both lived in ops/tokenize.py; a state saved then must still match.
    assert Tokenize(tok).config()["op"] == "zephon_torch.ops.tokenize.Tokenize"
    assert TokenizeChat(tok).config()["op"] == "zephon_torch.ops.tokenize.TokenizeChat"

    class Mine(TokenizeChat):
        pass

    assert Mine(tok).config()["op"].endswith(".Mine")  # a subclass is named for itself


# --------------------------------------------------------------------------- default special tokens


def test_the_default_adds_one_eos_so_packed_documents_are_separated_by_one_token(tmp_path):
    # A GPT-2-style tokenizer: "<|endoftext|>" is its only special token, BOS and EOS
    # at once. The default used to put it at both ends of every document.
    gpt2_style, _ = train_test_tokenizer(tmp_path, special_tokens=("<|endoftext|>",))
    texts = ["the quick brown fox", "kazo phelin tra", "hello world"]
    out = Tokenize(gpt2_style).process_many(_texts(texts))
    assert [r.payload["input_ids"].tolist() for r in out] == [
        [*_enc(gpt2_style, t), EOT] for t in texts]
    row = np.concatenate([r.payload["input_ids"] for r in out])  # what pack_flat lays out
    assert not ((row[1:] == EOT) & (row[:-1] == EOT)).any()
    assert int((row == EOT).sum()) == len(texts)


def test_an_explicit_id_for_a_token_the_mode_does_not_add_is_an_error(tok):
    with pytest.raises(ValueError, match=r"^bos_token_id=1 is given, but special_tokens='eos' "
                                         r"adds no BOS; pass special_tokens='bos_eos'"):
        Tokenize(tok, bos_token_id=1)
    with pytest.raises(ValueError, match=r"eos_token_id=0 is given, but special_tokens='none'"):
        Tokenize(tok, special_tokens="none", eos_token_id=0)


# --------------------------------------------------------------------------- tokenizer directories


def _tok_dir(path, tok, **files):
    """A tokenizer directory as save_pretrained writes one: tokenizer.json plus the
    given files (dicts become JSON, strings are written as they are)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
    for name, content in files.items():
        name = name.replace("__", ".")
        text = content if isinstance(content, str) else json.dumps(content)
        (path / name).write_text(text, encoding="utf-8")
    return path


def test_a_tokenizer_directory_takes_its_special_tokens_from_tokenizer_config(tmp_path, tok):
    # The names alone would give BOS "<s>" (1) and EOS "<|endoftext|>" (0).
    d = _tok_dir(tmp_path / "tok", tok, tokenizer_config__json={
        "eos_token": "</s>", "pad_token": "<s>",
        "bos_token": {"__type": "AddedToken", "content": "<pad>", "special": True}})
    op = Tokenize(d, special_tokens="bos_eos")
    assert (op.bos_token_id, op.eos_token_id, op.pad_token_id) == (3, 2, 1)
    assert op.special_token_sources["eos"] == (
        f"eos_token '</s>' in tokenizer_config.json in the tokenizer directory {str(d)!r}")
    (res,) = Tokenize(d).process_many(_texts(["the fox"]))
    assert res.payload["input_ids"].tolist() == [*_enc(tok, "the fox"), 2]
    # The file inside the directory is a bare tokenizer.json: names are guessed.
    assert Tokenize(d / "tokenizer.json").eos_token_id == EOT


def test_special_tokens_map_fills_in_what_tokenizer_config_leaves_out(tmp_path, tok):
    d = _tok_dir(tmp_path / "tok", tok, tokenizer_config__json={"bos_token": "</s>"},
                 special_tokens_map__json={"bos_token": "<s>", "eos_token": "<pad>"})
    op = Tokenize(d, special_tokens="bos_eos")
    assert (op.bos_token_id, op.eos_token_id) == (2, 3)
    assert "tokenizer_config.json and special_tokens_map.json" in op.special_token_sources["eos"]


def test_a_configured_directory_without_eos_is_an_error_not_a_guess(tmp_path, tok):
    d = _tok_dir(tmp_path / "tok", tok, tokenizer_config__json={"bos_token": "<s>"})
    with pytest.raises(ValueError) as err:
        Tokenize(d)
    assert str(err.value) == (
        f"special_tokens='eos' needs special token ids that the tokenizer directory {str(d)!r} "
        f"does not name: no EOS token (tokenizer_config.json in the tokenizer directory "
        f"{str(d)!r} names no eos_token; token names are not guessed); pass eos_token_id=<id> "
        "(or choose another special_tokens mode)")


def test_a_configured_token_outside_the_vocabulary_names_the_file(tmp_path, tok):
    d = _tok_dir(tmp_path / "tok", tok, tokenizer_config__json={"eos_token": "<|im_end|>"})
    with pytest.raises(ValueError, match=r"^eos_token '<\|im_end\|>' named in tokenizer_config"
                                         r"\.json in the tokenizer directory .* is not in the "
                                         r"tokenizer's vocabulary; pass eos_token_id=<id>"):
        Tokenize(d)


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"eos_token": 7}'])
def test_a_broken_tokenizer_config_names_the_file(tmp_path, tok, content):
    d = _tok_dir(tmp_path / "tok", tok, tokenizer_config__json=content)
    with pytest.raises(ValueError, match=r"tokenizer_config\.json"):
        Tokenize(d)


def test_a_bare_tokenizer_error_says_the_names_were_guessed(bare_tok):
    with pytest.raises(ValueError, match=r"needs special token ids that the tokenizers.Tokenizer "
                                         r"does not name: no EOS token \(looked for \[.*\] by "
                                         r"name: the tokenizers.Tokenizer comes without a "
                                         r"tokenizer_config.json\); pass eos_token_id=<id>"):
        Tokenize(bare_tok)


# --------------------------------------------------------------------------- Jinja chat templates


CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHATML_GENERATION = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHAT_CONFIG = {"eos_token": "<|im_end|>", "pad_token": "<pad>", "bos_token": None}


@pytest.fixture
def chat_tok(tok):
    """The test tokenizer with ChatML's two special tokens added."""
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return tok


def _chat_dir(path, tok, template, config=CHAT_CONFIG):
    return _tok_dir(path, tok, tokenizer_config__json=config, chat_template__jinja=template)


def _chat(op, messages=CONVO):
    (res,) = op.process_many([_rec(0, {"messages": messages})])
    return res.payload["input_ids"], res.payload["loss_mask"]


def _supervised(tok, ids, mask):
    return [tok.decode(ids[a:b].tolist(), skip_special_tokens=False) for a, b in _runs(mask)]


def test_chat_renders_the_directory_template_as_transformers_does(tmp_path, chat_tok):
    transformers = pytest.importorskip("transformers")
    d = _chat_dir(tmp_path / "tok", chat_tok, CHATML)
    op = TokenizeChat(d)
    assert (op.template_kind, op.special_tokens) == ("jinja", "none")
    assert op.chat_template_source == repr(str(d / "chat_template.jinja"))
    ids, mask = _chat(op)
    fast = transformers.AutoTokenizer.from_pretrained(str(d))
    expected = fast.apply_chat_template(CONVO, tokenize=True, return_dict=True)["input_ids"]
    assert ids.tolist() == list(expected) and ids.dtype == np.int32 and mask.dtype == np.uint8
    # Found prefix by prefix: each reply with everything the template adds to it.
    replies = [m["content"] for m in CONVO if m["role"] == "assistant"]
    assert _supervised(chat_tok, ids, mask) == [r + "<|im_end|>\n" for r in replies]
    # The transformers tokenizer itself brings the same template and special tokens.
    assert [a.tolist() for a in _chat(TokenizeChat(fast))] == [ids.tolist(), mask.tolist()]


def test_chat_generation_blocks_mask_what_transformers_masks(tmp_path, chat_tok):
    transformers = pytest.importorskip("transformers")
    d = _chat_dir(tmp_path / "tok", chat_tok, CHATML_GENERATION)
    ids, mask = _chat(TokenizeChat(d))
    fast = transformers.AutoTokenizer.from_pretrained(str(d))
    expected = fast.apply_chat_template(CONVO, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    assert ids.tolist() == list(expected["input_ids"])
    assert mask.tolist() == list(expected["assistant_masks"])
    replies = [m["content"] for m in CONVO if m["role"] == "assistant"]
    assert _supervised(chat_tok, ids, mask) == [r + "<|im_end|>" for r in replies]
    ids, mask = _chat(TokenizeChat(d, loss_on_last_turn_only=True))
    assert _supervised(chat_tok, ids, mask) == [replies[-1] + "<|im_end|>"]


@pytest.mark.parametrize("form", ["string", "named list"])
def test_chat_template_from_tokenizer_config(tmp_path, chat_tok, form):
    reference = _chat(TokenizeChat(_chat_dir(tmp_path / "ref", chat_tok, CHATML)))
    value = CHATML if form == "string" else [{"name": "tool_use", "template": "x"},
                                             {"name": "default", "template": CHATML}]
    d = _tok_dir(tmp_path / "tok", chat_tok,
                 tokenizer_config__json={**CHAT_CONFIG, "chat_template": value})
    assert [a.tolist() for a in _chat(TokenizeChat(d))] == [a.tolist() for a in reference]


def test_named_templates_without_a_default_are_an_error(tmp_path, chat_tok):
    d = _tok_dir(tmp_path / "tok", chat_tok, tokenizer_config__json={
        **CHAT_CONFIG, "chat_template": [{"name": "tool_use", "template": CHATML}]})
    with pytest.raises(ValueError, match=r"named templates \['tool_use'\] without a 'default'"):
        TokenizeChat(d)
    assert Tokenize(d).eos_token_id == chat_tok.token_to_id("<|im_end|>")  # tokenize never asks


def test_a_directory_without_template_falls_back_to_the_built_in_one(tmp_path, tok):
    d = _tok_dir(tmp_path / "tok", tok, tokenizer_config__json={"eos_token": "<|endoftext|>",
                                                                "bos_token": "<s>"})
    op = TokenizeChat(d)
    assert (op.template_kind, op.special_tokens) == ("format", "bos_eos")
    assert [a.tolist() for a in _chat(op)] == [a.tolist() for a in _chat(TokenizeChat(tok))]


def test_a_jinja_string_template_sees_the_guessed_special_tokens_of_a_bare_tokenizer(tok):
    # Newlines as {{ '\\n' }}: trim_blocks (as in transformers) drops one after a block tag.
    template = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
                "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}"
                "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    messages = [{"role": "user", "content": "Hello world?"},
                {"role": "assistant", "content": "quick brown fox."}]
    ids, mask = _chat(TokenizeChat(tok, chat_template=template), messages)
    assert ids[0] == BOS and mask[0] == 0
    # " quick" is one token covering the prompt's last space and the reply's "q": it is
    # the reply's (as transformers' assistant mask counts it).
    assert tok.token_to_id("\u0120quick") is not None
    assert _supervised(tok, ids, mask) == [" quick brown fox.<|endoftext|>\n"]
    assert tok.decode(ids.tolist(), skip_special_tokens=False) == (
        "<s>user: Hello world?\nassistant: quick brown fox.<|endoftext|>\n")


def test_a_template_that_does_not_render_prefix_by_prefix_is_refused_per_sample(tok):
    # The number of messages comes first, so a shorter conversation is no prefix.
    template = ("{{ messages | length }}\n{% for m in messages %}{{ m['role'] }}: "
                "{{ m['content'] }}\n{% endfor %}")
    op = TokenizeChat(tok, chat_template=template)
    recs = [_rec(0, {"messages": CONVO[:2]}), _rec(1, {"messages": CONVO})]
    with pytest.raises(ValueError) as err:
        op.process_many(recs)
    assert str(err.value).startswith(
        "tokenize_chat: sample (0, 3, 1): the chat template (the chat_template argument) does "
        "not render this conversation prefix by prefix: messages[:2] with the generation "
        "prompt, then messages[:3], are not the start of the whole conversation, so the tokens "
        "of assistant message 2 cannot be located; use a template that marks replies with "
        "{% generation %} ... {% endgeneration %}")
    out = TokenizeChat(tok, chat_template=template, on_error="skip").process_many(recs)
    assert out[0].payload["loss_mask"].sum() == 0  # no assistant turn: nothing to locate
    assert out[1].meta.tags[TOMBSTONE_REASON_TAG] == "tokenize_chat_error"


def test_jinja_templates_refuse_operator_special_tokens_and_stray_kwargs(tmp_path, chat_tok):
    d = _chat_dir(tmp_path / "tok", chat_tok, CHATML)
    with pytest.raises(ValueError, match=r"special_tokens='bos_eos' cannot be used with the "
                                         r"Jinja chat template \(.*chat_template\.jinja'\)"):
        TokenizeChat(d, special_tokens="bos_eos")
    with pytest.raises(ValueError, match=r"eos_token_id=0 cannot be used with the Jinja chat "
                                         r"template \("):
        TokenizeChat(d, eos_token_id=0)
    with pytest.raises(ValueError, match="chat_template_kwargs are variables of a Jinja"):
        TokenizeChat(chat_tok, chat_template_kwargs={"x": 1})
    with pytest.raises(ValueError, match=r"cannot set \['messages'\]"):
        TokenizeChat(d, chat_template_kwargs={"messages": []})
    with pytest.raises(ValueError, match="JSON values"):
        TokenizeChat(d, chat_template_kwargs={"when": object()})
    with pytest.raises(ValueError, match=r"^the chat template \(the chat_template argument\) "
                                         r"is not valid Jinja \(line 1"):
        TokenizeChat(chat_tok, chat_template="{% for m in messages %}{{ m }}")


def test_the_clock_is_not_read_and_template_kwargs_are(tok):
    reads_clock = ("{{ strftime_now('%d %b %Y') }}"
                   "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ValueError, match=r"strftime_now.*chat_template_kwargs"):
        _chat(TokenizeChat(tok, chat_template=reads_clock))
    falls_back = ("{% if strftime_now is defined %}{% set d = strftime_now('%Y') %}"
                  "{% elif date_string is defined %}{% set d = date_string %}"
                  "{% else %}{% set d = '26 Jul 2024' %}{% endif %}"
                  "{{ d }}\n{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    ids, _ = _chat(TokenizeChat(tok, chat_template=falls_back), CONVO[:1])
    assert tok.decode(ids.tolist()) == "26 Jul 2024\nYou are kazo.\n"
    op = TokenizeChat(tok, chat_template=falls_back, chat_template_kwargs={"date_string": "x"})
    assert tok.decode(_chat(op, CONVO[:1])[0].tolist()) == "x\nYou are kazo.\n"
    assert op.config()["chat_template_variables"]["date_string"] == "x"


def test_jinja_chat_is_stateless_picklable_and_cut_like_the_others(tmp_path, chat_tok):
    d = _chat_dir(tmp_path / "tok", chat_tok, CHATML)
    convos = [CONVO[: k + 1] for k in range(len(CONVO))] + [CONVO[2:]]
    recs = [_rec(i, {"messages": c}) for i, c in enumerate(convos)]
    op = TokenizeChat(d, max_length=12)
    whole = op.process_many(recs)
    assert all(len(r.payload["input_ids"]) <= 12 for r in whole)
    assert [o for r in recs for o in op.process_one(r)] == whole
    assert op.process_many(recs[:2]) + op.process_many(recs[2:]) == whole
    back = pickle.loads(pickle.dumps(op))
    assert back._jinja is None and back._tok is None
    assert back.process_many(recs) == whole and back.config() == op.config()
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        assert pool.submit(op.process_many, recs).result(timeout=60) == whole
    cfg = op.config()
    assert json.loads(json.dumps(cfg)) == cfg and len(cfg["chat_template"]["jinja_sha256"]) == 64
    assert cfg["chat_template_variables"]["eos_token"] == "<|im_end|>"
    other = TokenizeChat(_chat_dir(tmp_path / "gen", chat_tok, CHATML_GENERATION), max_length=12)
    assert other.config()["chat_template"] != cfg["chat_template"]


def test_a_jinja_chat_the_tokenizer_cannot_encode_fails_alone(tmp_path, chat_tok):
    d = _chat_dir(tmp_path / "tok", chat_tok, CHATML)
    bad = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x\ud800"}]
    recs = [_rec(0, {"messages": CONVO}), _rec(1, {"messages": bad}),
            _rec(2, {"messages": CONVO})]
    with pytest.raises(ValueError, match=r"^tokenize_chat: sample \(0, 3, 1\): the content of "
                                         r"message 1 \(assistant\) holds a lone UTF-16"):
        TokenizeChat(d).process_many(recs)
    out = TokenizeChat(d, on_error="skip").process_many(recs)
    assert out[1].meta.tags[TOMBSTONE_REASON_TAG] == "tokenize_chat_error"
    assert out[0].payload["input_ids"].tolist() == out[2].payload["input_ids"].tolist()


@pytest.mark.parametrize(
    "case", cases_for("zephon_torch.ops.tokenize", "zephon_torch.ops.tokenize_chat"))
def test_tokenize_and_tokenize_chat_keep_the_operator_contract(
        case: str, contract_data: ContractData) -> None:
    """Every runner, worker count and micro-batch size gives the inline output, each lane
    the same on any number of ranks, every sample is delivered or tombstoned once, and a
    checkpoint after any output resumes exactly (``zephon_torch.testing``)."""
    check_case(case, contract_data)
