"""Detokenizer: incremental decoding with the real SmolLM2 tokenizer, and the real process over ipc.

The end-to-end tests of this module are in tests/e2e/test_detokenizer_e2e.py.
"""

from __future__ import annotations

import multiprocessing as mp
import random

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from workbench.core.io_struct import (
    BatchStrOut,
    BatchTokenIDOut,
    FlushCacheReqOutput,
    decode_msg,
    encode_msg,
)
from workbench.core.ipc import PortArgs, get_zmq_socket, send_msg
from workbench.core.managers.detokenizer_manager import DetokenizerManager, run_detokenizer_process
from workbench.core.managers.incremental_detokenize import IncrementalDetokenizer, stop_safe_end
from workbench.core.trace.events import ProcStarted, decode_batch

MIXED = "Café naïve — ½ 😀🎉 👨‍👩‍👧 🇯🇵 中文字符 日本語のテキスト 한국어 e\u0301 Ωμέγα!"


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def make_batch(
    rids, new_ids, finished=None, matched=None, skip=True, spaces=True, no_stop_trim=False, stop_strs=None
) -> BatchTokenIDOut:
    n = len(rids)
    per = lambda v, default: list(v) if isinstance(v, list) else [default if v is None else v] * n  # noqa: E731
    return BatchTokenIDOut(
        rids=list(rids),
        new_token_ids=[list(x) for x in new_ids],
        finished_reasons=per(finished, None),
        matched_stops=per(matched, None),
        prompt_tokens=[3] * n,
        completion_tokens=[len(x) for x in new_ids],
        cached_tokens=[0] * n,
        skip_special_tokens=per(skip, True),
        spaces_between_special_tokens=per(spaces, True),
        no_stop_trim=per(no_stop_trim, False),
        stop_strs=stop_strs
        if stop_strs is not None and stop_strs and isinstance(stop_strs[0], list)
        else [list(stop_strs or [])] * n,
    )


def stream_one(detok, ids, chunks=None, finished="length", matched=None, **kw) -> list[str]:
    """Feed ids of one request in chunks (default: one id at a time); the last chunk finishes it."""
    chunks = chunks or [1] * len(ids)
    deltas, pos = [], 0
    for k, size in enumerate(chunks):
        last = k == len(chunks) - 1
        part = ids[pos:] if last else ids[pos : pos + size]
        pos += size
        deltas += detok.process(
            make_batch(["r"], [part], finished=finished if last else None, matched=matched if last else None, **kw)
        )
    return deltas


def stream_with_stop_check(tokenizer, detok, ids, stops, no_stop_trim=False):
    """Feed ids one by one, finishing the way the scheduler does when a stop string shows up.

    Returns (deltas, cumulative texts after each step, matched stop or None).
    """
    deltas, cumulative = [], []
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k])
        hits = [(text.find(s), s) for s in stops if s in text]
        matched = min(hits)[1] if hits else None
        finished = "stop" if matched else ("length" if k == len(ids) else None)
        deltas += detok.process(
            make_batch(
                ["r"], [[ids[k - 1]]], finished=finished, matched=matched, no_stop_trim=no_stop_trim, stop_strs=stops
            )
        )
        cumulative.append("".join(deltas))
        if finished:
            return deltas, cumulative, matched
    raise AssertionError("never finished")


# ---- (1) characters split across byte-level tokens ---------------------------


@pytest.mark.parametrize("use_rust_batch", [True, False], ids=["rust_batch", "hf_batch_decode"])
def test_split_utf8_never_emitted_half(tokenizer, use_rust_batch):
    ids = tokenizer.encode(MIXED)
    # The test only means something if some characters really straddle tokens.
    assert sum("\ufffd" in tokenizer.decode([i]) for i in ids) >= 5
    detok = IncrementalDetokenizer(tokenizer, use_rust_batch=use_rust_batch)
    deltas = stream_one(detok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some steps had to wait for the rest of a character
    assert "".join(deltas) == tokenizer.decode(ids) == MIXED
    assert len(detok) == 0


MB_ALPHABET = "ab lo wéüñ½—😀🎉👍中文字日本語한국\u0301\n!?."


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=MB_ALPHABET, min_size=1, max_size=40), data=st.data())
def test_random_text_and_chunking_roundtrip(tokenizer, text, data):
    ids = tokenizer.encode(text)
    if not ids:
        return
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=len(ids)))
    detok = IncrementalDetokenizer(tokenizer)
    deltas = stream_one(detok, ids, chunks=chunks)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids)


def test_a_long_window_ending_inside_a_character_commits_only_whole_characters(tokenizer):
    """Found by the property test above: when every message ends inside a character, the window of
    uncommitted ids grows past the 16-id bound; it is then committed up to its last whole character,
    never with a U+FFFD that the next message completes."""
    text = "a?a?\u0301?a語한?a日日"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = stream_one(detok, ids, chunks=[1, 4, 4, 3, 4, 2, 1])
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids)


# ---- (2)/(3) stop strings -----------------------------------------------------


def test_stop_string_across_token_boundary_is_trimmed_and_never_leaked(tokenizer):
    ids = tokenizer.encode("Say hello world to everyone")
    pieces = [tokenizer.decode([i]) for i in ids]
    assert " hello" in pieces and " world" in pieces  # "lo wor" really spans two tokens
    detok = IncrementalDetokenizer(tokenizer)
    deltas, cumulative, matched = stream_with_stop_check(tokenizer, detok, ids, ["lo wor"])
    assert matched == "lo wor"
    assert "".join(deltas) == "Say hel"
    # While " hello" was the newest token, its "lo" was held back.
    assert cumulative[pieces.index(" hello")] == "Say hel"
    assert all("Say hel".startswith(c) for c in cumulative)
    assert len(detok) == 0


def test_held_prefix_is_released_when_disproved(tokenizer):
    ids = tokenizer.encode("hello there")
    detok = IncrementalDetokenizer(tokenizer)
    deltas, cumulative, matched = stream_with_stop_check(tokenizer, detok, ids, ["lo wor"])
    assert matched is None
    assert cumulative[0] == "hel"
    assert "".join(deltas) == "hello there"


def test_no_stop_trim_keeps_stop_string(tokenizer):
    ids = tokenizer.encode("Say hello world to everyone")
    detok = IncrementalDetokenizer(tokenizer)
    deltas, _, matched = stream_with_stop_check(tokenizer, detok, ids, ["lo wor"], no_stop_trim=True)
    assert matched == "lo wor"
    assert "".join(deltas) == "Say hello world"  # up to the end of the token that completed it


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet="ab lo wé😀中文", min_size=1, max_size=30), data=st.data())
def test_stop_strings_property(tokenizer, text, data):
    ids = tokenizer.encode(text)
    if not ids:
        return
    full = tokenizer.decode(ids)
    stops = []
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(full) - 1))
        stops.append(full[i : i + data.draw(st.integers(1, 4))])
    stops.append(data.draw(st.text(alphabet="ab lo", min_size=1, max_size=3)))
    detok = IncrementalDetokenizer(tokenizer)
    deltas, cumulative, matched = stream_with_stop_check(tokenizer, detok, ids, stops)
    final = "".join(deltas)
    assert all(final.startswith(c) for c in cumulative)  # nothing is ever taken back
    if matched is None:
        assert final == full
    else:
        assert not any(s in final for s in stops)
        assert final == tokenizer.decode(ids[: len(cumulative)]).split(matched, 1)[0]


def test_stop_safe_end_holds_longest_possible_prefix():
    assert stop_safe_end("abc hel", 0, ["hello", "lx"]) == len("abc ")
    assert stop_safe_end("abc hel", 0, ["l"]) == len("abc he")  # a whole stop string
    assert stop_safe_end("abc he", 0, ["xyz"]) == len("abc he")
    assert stop_safe_end("abc he", 6, ["e!"]) == 6  # nothing pending


# ---- (4) special tokens and stop token ids -------------------------------------


def test_skip_special_tokens_and_stop_token_ids(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    body = tokenizer.encode("Hi there.")

    def final(ids, **kw):
        return "".join(stream_one(IncrementalDetokenizer(tokenizer), ids, **kw))

    assert final(body + [eos], finished="stop", matched=eos, skip=True) == "Hi there."
    assert final(body + [eos], finished="stop", matched=eos, skip=True, no_stop_trim=True) == "Hi there."
    # Without skipping, the matched EOS is trimmed unless no_stop_trim.
    assert final(body + [eos], finished="stop", matched=eos, skip=False) == "Hi there."
    assert final(body + [eos], finished="stop", matched=eos, skip=False, no_stop_trim=True) == "Hi there.<|im_end|>"
    # skip_special_tokens drops special tokens anywhere, not only the stop token.
    assert final([eos] + body, finished="length", skip=True) == "Hi there."
    assert final([eos] + body, finished="length", skip=False) == "<|im_end|>Hi there."
    # A non-special stop_token_id ('.') is trimmed unless no_stop_trim.
    dot = body[-1]
    assert tokenizer.decode([dot]) == "."
    assert final(body, finished="stop", matched=dot) == "Hi there"
    assert final(body, finished="stop", matched=dot, no_stop_trim=True) == "Hi there."


# ---- (5) many requests interleaved ----------------------------------------------


def test_many_rids_interleaved_and_released(tokenizer):
    rng = random.Random(0)
    texts = [
        MIXED,
        "hello world, how are you?",
        "日本語のテキスト 😀",
        "e\u0301te\u0301 à Paris",
        "Numbers 12345 and symbols #$%",
        "🎉🎉🎉 party",
        "한국어 텍스트",
        "plain ascii text here",
    ]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    reqs = {f"rid{i}": tokenizer.encode(t) + [eos] for i, t in enumerate(texts)}
    pos = {rid: 0 for rid in reqs}
    skip = {rid: i % 2 == 0 for i, rid in enumerate(reqs)}  # two decode groups per batch
    got = {rid: [] for rid in reqs}
    detok = IncrementalDetokenizer(tokenizer)
    peak = 0
    while any(pos[r] < len(ids) for r, ids in reqs.items()):
        live = [r for r, ids in reqs.items() if pos[r] < len(ids)]
        step = rng.sample(live, rng.randint(1, len(live)))
        new, fin, matched = [], [], []
        for r in step:
            k = rng.randint(1, 3)
            new.append(reqs[r][pos[r] : pos[r] + k])
            pos[r] = min(pos[r] + k, len(reqs[r]))
            done = pos[r] == len(reqs[r])
            fin.append("stop" if done else None)
            matched.append(eos if done else None)
        deltas = detok.process(make_batch(step, new, finished=fin, matched=matched, skip=[skip[r] for r in step]))
        assert len(deltas) == len(step)
        for r, d in zip(step, deltas):
            assert "\ufffd" not in d
            got[r].append(d)
        peak = max(peak, len(detok))
    assert peak > 1
    for i, rid in enumerate(reqs):
        assert "".join(got[rid]) == texts[i], rid
    assert len(detok) == 0  # every finished request was released


def test_lru_cap_bounds_unfinished_states(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, max_states=4)
    ids = tokenizer.encode("hello")
    for i in range(6):
        detok.process(make_batch([f"r{i}"], [ids]))
    assert len(detok) == 4
    assert list(detok.decode_status) == ["r2", "r3", "r4", "r5"]


# ---- the manager, in process and as a real process --------------------------------


@pytest.fixture
def port_args():
    pa = PortArgs.create()
    yield pa
    pa.cleanup()


def test_manager_isolates_a_bad_request_and_forwards_control(tokenizer, port_args):
    mgr = DetokenizerManager(tokenizer, port_args)
    try:
        good = tokenizer.encode("hello world")
        out = mgr.handle_msg(make_batch(["good", "bad"], [good, [-1]]))
        assert isinstance(out, BatchStrOut)
        assert out.text_deltas[0] == "hello world" and out.text_deltas[1] == ""
        assert out.finished_reasons == [None, "abort"]
        assert out.error_messages[0] is None and "detokenizer" in out.error_messages[1]
        assert list(mgr.detokenizer.decode_status) == ["good"]
        ctrl = FlushCacheReqOutput(success=True, message="ok")
        assert mgr.handle_msg(ctrl) is ctrl
    finally:
        mgr.close()


def _recv(sock: zmq.Socket, timeout_s: float = 60.0):
    assert sock.poll(int(timeout_s * 1000)), "no message from the detokenizer"
    return decode_msg(sock.recv())


def test_detokenizer_process_over_ipc(tokenizer_dir, tokenizer, port_args):
    ctx = zmq.Context()
    from_detok = get_zmq_socket(ctx, zmq.PULL, port_args.tokenizer_ipc_name, bind=True)
    trace_bus = get_zmq_socket(ctx, zmq.PULL, port_args.trace_ipc_name, bind=True)
    reader, writer = mp.get_context("spawn").Pipe(duplex=False)
    proc = mp.get_context("spawn").Process(
        target=run_detokenizer_process, args=(tokenizer_dir, port_args, writer), daemon=True
    )
    proc.start()
    try:
        assert reader.poll(120), "detokenizer never reported ready"
        ready = reader.recv()
        assert ready["status"] == "ready" and ready["pid"] == proc.pid
        assert trace_bus.poll(30_000), "no proc.started on the trace bus"
        (started,) = decode_batch(trace_bus.recv())
        assert isinstance(started, ProcStarted)
        assert (started.pid, started.role, started.proc) == (proc.pid, "detokenizer", "detokenizer")
        to_detok = get_zmq_socket(ctx, zmq.PUSH, port_args.detokenizer_ipc_name, bind=False)
        ids = tokenizer.encode("hello world 😀")
        send_msg(to_detok, make_batch(["a", "b"], [ids[:1], ids], finished=[None, "length"], stop_strs=[["lo!"], []]))
        out = _recv(from_detok)
        assert isinstance(out, BatchStrOut)
        assert out.rids == ["a", "b"] and out.new_token_ids == [ids[:1], ids]
        assert out.text_deltas == ["hel", "hello world 😀"]  # "lo" might start "lo!"
        assert out.finished_reasons == [None, "length"] and out.completion_tokens == [1, len(ids)]
        send_msg(to_detok, make_batch(["a"], [ids[1:]], finished=["length"], stop_strs=[["lo!"]]))
        assert _recv(from_detok).text_deltas == ["lo world 😀"]
        ctrl = FlushCacheReqOutput(success=True, message="flushed")
        send_msg(to_detok, ctrl)
        assert encode_msg(_recv(from_detok)) == encode_msg(ctrl)
        to_detok.close()
    finally:
        proc.terminate()
        proc.join(30)
        from_detok.close()
        trace_bus.close()
        ctx.term()
    assert proc.exitcode == 0  # SIGTERM is a clean exit, not a kill


def test_bare_rust_tokenizer_decodes_exactly_like_transformers(tokenizer_dir, tokenizer):
    """The detokenizer process decodes with `tokenizers` alone (no transformers, no torch);
    that must give transformers' text for any ids: special tokens, split UTF-8, both skip modes."""
    from workbench.core.managers.incremental_detokenize import load_decode_tokenizer, make_batch_decoder

    bare = load_decode_tokenizer(tokenizer_dir)
    assert type(bare).__module__.startswith("tokenizers"), "the converted tokenizer should load bare"
    decode = make_batch_decoder(bare)
    rng = random.Random(0)
    specials = list(tokenizer.all_special_ids)
    seqs = [tokenizer.encode(MIXED), tokenizer.encode(MIXED)[3:17]]
    seqs += [
        [
            rng.choice(specials) if rng.random() < 0.15 else rng.randrange(len(tokenizer))
            for _ in range(rng.randrange(1, 40))
        ]
        for _ in range(200)
    ]
    for skip in (True, False):
        assert decode(seqs, skip, True) == tokenizer.batch_decode(seqs, skip_special_tokens=skip)
