"""Commands that start fast: every command parses its usual forms
without argparse (myq._quick_args, by what its builders declare: a
_Spec), `myq enqueue` decodes its payload with _json's C
scanner alone (myq._decode) and checks names without re (myq._is_name);
json and re are imported at their first use, regular expressions compiled
at theirs.  Each shortcut is held to the long way: the same Namespace as
argparse's, the same job file, output, error and exit status as the
argparse path, the same value or error as json's decoder, the same verdict
as NAME_RE.  And an enqueue really imports none of argparse, json, re."""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _core import MYQ, ROOT, call_myq, clean_env
from _pythons import IDS, PYTHONS

sys.path.insert(0, ROOT)
import myq  # noqa: E402

# words of an enqueue command line: options (spelt in full, abbreviated,
# joined with =), values good and bad, payloads, and what argparse alone
# takes (--help, --, other commands)
WORDS = [
    "enqueue", "--spool", "--spool=SPOOL", "SPOOL", "--id", "--id=x1",
    "--id=", "x1", "a.b", ".x", "", "t", "enqueue", "--delay", "5", "1.5",
    "5s", "-1", "-", "--delay=-1", "--delay=2m", "nan", "--priority", "3",
    "10", "--priority=-9", "--ttl", "0", "60", "--max-attempts", "2", "0",
    " 3 ", "--timeout", "1h", "--min-free", "1M", "--min-free=0",
    "--max-job-bytes=100", "--keep-done", "x", "--pri", "-h", "--help",
    "--", "{}", "[1, 2]", "null", '"s"', "{bad", "1e400", "NaN", "worker",
    "--dedupe-window=1d", "--json", "-1.5", "--max_attempts", "é",
]
argvs = st.one_of(
    st.lists(st.sampled_from(WORDS), max_size=8),
    st.tuples(st.lists(st.sampled_from(["--spool", "SPOOL", "--spool=SPOOL"]),
                       max_size=2),
              st.lists(st.sampled_from(WORDS), max_size=7)).map(
        lambda t: t[0] + ["enqueue"] + t[1]))


def _argparse(argv):
    """vars() of the full parser's answer, or the error it raises."""
    try:
        return vars(myq._parser().parse_args(argv))
    except myq.UsageError as e:
        return ("UsageError", str(e))
    except SystemExit as e:
        return ("SystemExit", e.code)


@settings(max_examples=600, deadline=None)
@given(argvs)
def test_quick_args_are_argparse_args(argv):
    """Whatever _quick_args answers for an enqueue, argparse answers the
    same Namespace."""
    fast = myq._quick_args(argv)
    if fast is None:
        return
    # (compared by repr: both parsers take `--timeout NaN` as nan, which
    # is not equal to itself; the job's own checks refuse it later)
    assert _same(vars(fast)) == _same(_argparse(argv)), argv


def _same(answer):
    return repr(sorted(answer.items())) if isinstance(answer, dict) else answer


def test_quick_args_take_the_usual_forms():
    """(The test above would pass with a _quick_args that never answers.)"""
    usual = [
        ["--spool", "S", "enqueue", "t"],
        ["--spool", "S", "enqueue", "t", '{"a": 1}'],
        ["--spool=S", "enqueue", "t", "-"],
        ["enqueue", "--spool", "S", "--id", "x", "t", "{}"],
        ["--spool", "S", "enqueue", "t", "{}", "--id=x", "--delay", "5s",
         "--priority", "3", "--ttl", "1h", "--max-attempts", "2",
         "--timeout", "30", "--min-free", "1M", "--max-job-bytes=100K"],
    ]
    for argv in usual:
        fast = myq._quick_args(argv)
        assert fast is not None, argv
        assert vars(fast) == _argparse(argv), argv
    for argv in (["enqueue", "--help"], ["--spool", "S", "enqueue"],
                 ["enqueue", "t", "--id", "x", "{}"], ["enqueue", "--pri", "3", "t"],
                 ["enqueue", "t", "-1"], ["enqueue", "--delay", "soon", "t"],
                 ["stats", "-h"], ["enqueue", "t", "{}", "extra"], ["--version"],
                 ["init", "--store", "nosuch"], ["stats", "--", "x"],
                 ["delete", "a", "--force", "b"], ["worker", "--conc", "2"]):
        assert myq._quick_args(argv) is None, argv


# A value for an option or a positional, the first of these its type and
# choices take (argparse is asked: the test knows no option's kind).
SAMPLES = ["3", "5s", "1M", "0.5", "true", "t", "a=b", "fwd", "unix:/x",
           "127.0.0.1:1", "t=fwd", "mqtt://h", "dead", "files", "sqlite",
           "1h", "x.json"]


def _options(name):
    """(flags of value options, flags without a value, positionals) of
    command `name`, as its argparse parser has them."""
    p = myq._parser(name)._subparsers._group_actions[0].choices[name]
    values, bare, places = [], [], []
    for a in p._actions:
        if not a.option_strings:
            places.append(a)
        elif a.nargs == 0:
            if a.dest != "help":
                bare.append(a.option_strings[0])
        else:
            values.append(a.option_strings[0])
    return values, bare, places


def _sample(argv):
    """The first SAMPLES word that argparse takes at the end of `argv`."""
    for v in SAMPLES:
        if isinstance(_argparse(argv + [v]), dict):
            return v
    return None


@pytest.mark.parametrize("name", sorted(myq._COMMAND_TABLE))
def test_every_command_quick_where_usual(name):
    """Each command's options, one at a time and all together, and its
    positionals: _quick_args answers, and answers argparse's Namespace."""
    values, bare, places = _options(name)
    head = []
    for a in places:
        if a.nargs in (None, "+"):
            v = _sample(["--spool", "S", name] + head)
            assert v is not None, (name, a.dest)
            head.append(v)
    forms, every = [[]], []
    for flag in values:
        v = _sample(["--spool", "S", name] + head + [flag])
        if v is None:
            continue            # (none of SAMPLES: argparse alone)
        forms += [[flag, v], [flag + "=" + v]]
        every += [flag, v]
    forms += [[flag] for flag in bare] + [every + bare]
    asked = 0
    for form in forms:
        for argv in (["--spool", "S", name] + head + form,
                     [name] + form + head + ["--spool", "S"]):
            want = _argparse(argv)
            if not isinstance(want, dict):
                continue        # (two options that exclude each other)
            got = myq._quick_args(argv)
            assert got is not None, argv
            assert _same(vars(got)) == _same(want), argv
            asked += 1
    assert asked >= len(forms), name


def _command_words():
    words = ["--spool", "S", "--help", "--", "-", "-1", "x", "a=b", "3", "5s",
             "--json", "--all", "--force", "--state", "dead", "--type", "t"]
    for name in sorted(myq._COMMAND_TABLE):
        values, bare, _ = _options(name)
        words += [name] + values + bare + [f + "=" + "3" for f in values[:3]]
    return sorted(set(words))


COMMAND_WORDS = _command_words()


@settings(max_examples=800, deadline=None)
@given(st.sampled_from(sorted(myq._COMMAND_TABLE)),
       st.lists(st.sampled_from(COMMAND_WORDS), max_size=7))
def test_quick_args_of_any_command_are_argparse_args(name, words):
    """Whatever _quick_args answers for any command line, argparse
    answers the same."""
    argv = [name] + words
    got = myq._quick_args(argv)
    if got is not None:
        assert _same(vars(got)) == _same(_argparse(argv)), argv


def _normal(job):
    """A job file's fields that do not depend on when or by whom it was made."""
    return {k: v for k, v in job.items()
            if k not in ("id", "created_at", "updated_at", "available_at",
                         "expires_at")}


def _run(argv, spool, fast, monkey):
    """main(argv) in this process, the fast path on or off: (exit status,
    stdout with the generated id replaced, stderr, the job files)."""
    shutil.rmtree(spool, ignore_errors=True)
    myq.open_store(spool).init()
    if not fast:
        monkey.setattr(myq, "_quick_args", lambda argv: None)
    try:
        cp = call_myq(*[spool if a == "SPOOL" else a.replace("=SPOOL", "=" + spool)
                        for a in argv])
    finally:
        monkey.undo()
    jobs = []
    for top, _, names in sorted(os.walk(os.path.join(spool, "incoming"))):
        for name in sorted(names):
            with open(os.path.join(top, name)) as f:
                jobs.append((top[len(spool):], _normal(json.load(f))))
    # (a generated id, and a size that counts the digits of the time)
    out, err = (re.sub(r"is [0-9]+ bytes", "is N bytes",
                       re.sub(r"\b[0-9]{13}-[0-9a-f]{8}\b", "ID", t))
                for t in (cp.stdout, cp.stderr.replace(spool, "SPOOL")))
    return cp.returncode, out, err, jobs


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(argv=st.lists(st.sampled_from(WORDS), max_size=7))
def test_fast_path_and_argparse_path_agree(argv, monkeypatch):
    """The same command line, with and without _quick_args: the same exit
    status, output, error and job file (less its id and times)."""
    argv = ["--spool", "SPOOL", "enqueue"] + argv
    d = tempfile.mkdtemp(prefix="myq-fast-")
    try:
        spool = os.path.join(d, "spool")
        assert _run(argv, spool, True, monkeypatch) == \
            _run(argv, spool, False, monkeypatch), argv
    finally:
        shutil.rmtree(d)


json_text = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) |
    st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=3) |
    st.dictionaries(st.text(max_size=4), kids, max_size=3),
    max_leaves=12).map(json.dumps)
texts = st.one_of(
    json_text,
    json_text.map(lambda t: " \t" + t + "\n "),
    st.text(alphabet='{}[]",:0123456789.eE+-truefalsnNIiy \t\n\\u\u00e9\ud800',
            max_size=14),
    st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "[1e400]",
                     '"\\ud800"', "[" * 100000, "{} x", "1 2", "", " ",
                     '"\x01"', "[1,]", '{"a":1,"a":2}', "0x1", "01", "\u00a01"]))


def _outcome(fn, text):
    try:
        v = fn(text)
    except (ValueError, RecursionError) as e:
        return (type(e), str(e))
    return ("value", json.dumps(v, allow_nan=True))


@settings(max_examples=1500, deadline=None)
@given(texts)
def test_decode_is_the_decoders(text):
    assert _outcome(myq._decode, text) == _outcome(myq._DECODER.decode, text)


@settings(max_examples=1500, deadline=None)
@given(st.text(alphabet="abzAZ09._-/ \n\u00e9", max_size=140) |
       st.text(alphabet="ab.", min_size=126, max_size=131))
def test_is_name_is_name_re(value):
    assert myq._is_name(value) == bool(myq.NAME_RE.match(value))


@settings(max_examples=1000, deadline=None)
@given(st.text(alphabet=" \t\n\u00a0+-0123456789_\u0663\u00b2x", max_size=8))
def test_parse_int_takes_what_its_expression_took(text):
    took = bool(re.match(r"\s*[-+]?\d+\s*\Z", text))
    try:
        got = myq.parse_int(text)
    except ValueError:
        got = None
    assert (got is not None) == took and (got is None or got == int(text))


@settings(max_examples=1000, deadline=None)
@given(st.text(alphabet="ab.-@09\u0663", max_size=6) |
       st.text(alphabet="ab", min_size=127, max_size=129).map(lambda t: t + "@1"))
def test_lane_of_is_lane_re(name):
    m = myq.LANE_RE.match(name)
    assert myq._lane_of(name) == (m.groups() if m else None)


@settings(max_examples=1000, deadline=None)
@given(st.text(alphabet="09af-g\u0663", min_size=20, max_size=23) |
       st.builds(lambda a, b: a + "-" + b, st.text("0123456789", min_size=13, max_size=13),
                 st.text("0123456789abcdefA", min_size=8, max_size=8)))
def test_is_generated_id_is_generated_id_re(jid):
    assert myq._is_generated_id(jid) == bool(myq.GENERATED_ID_RE.match(jid))


def test_patterns_and_decoder_made_at_first_use():
    p = myq._Pattern(r"a(b)?\Z", 0)
    assert "match" not in vars(p)
    assert p.match("ab").group(1) == "b" and p.match("abc") is None
    assert "match" in vars(p) and p.pattern == r"a(b)?\Z"
    assert myq._MQTT_URL.match("MQTTS://u@h:1").groups() == ("MQTTS", "u", "h", "1")
    # a global names the compiled expression itself once it is made
    myq._FIELD.search("a b")
    assert myq._FIELD is re.compile(r"[\s,=]") or \
        type(myq._FIELD) is type(re.compile(""))


ENQUEUE_IMPORTS = r"""
import sys
sys.path.insert(0, sys.argv[1])
before = set(sys.modules)
import myq
rc = myq.main(["--spool", sys.argv[2], "enqueue", "t", '{"a": [1, 2.5, "\u00e9"]}',
               "--id", "j1", "--priority", "3", "--delay", "1.5"])
print(rc, " ".join(sorted(set(sys.modules) - before)))
"""


@pytest.mark.parametrize("py", [p[1] for p in PYTHONS], ids=IDS)
def test_an_enqueue_imports_no_argparse_json_re(tmp_path, py):
    """In a bare interpreter (-I -S: no site), `myq enqueue` imports myq
    and what it needs of the standard library's C parts, nothing heavy."""
    spool = str(tmp_path / "spool")
    myq.open_store(spool).init()
    cp = subprocess.run([py, "-I", "-S", "-c", ENQUEUE_IMPORTS, ROOT, spool],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        universal_newlines=True, env=clean_env(), timeout=120)
    assert cp.returncode == 0, cp.stderr
    rc, _, new = cp.stdout.strip().splitlines()[-1].partition(" ")
    assert rc == "0", cp.stdout
    new = set(new.split())
    heavy = {"argparse", "json", "re", "enum", "gettext", "locale", "shutil",
             "weakref", "functools", "collections", "importlib.util"}
    assert "myq" in new and not new & heavy, sorted(new)
    job = myq.open_store(spool).show("j1")
    assert job["payload"] == {"a": [1, 2.5, "\u00e9"]} and job["priority"] == 3
    assert MYQ.endswith("myq.py")


COMMAND_IMPORTS = r"""
import sys
sys.path.insert(0, sys.argv[1])
import myq
rc = myq.main(["--spool", sys.argv[2]] + sys.argv[3:])
print(rc, " ".join(sorted(m for m in ("argparse", "gettext") if m in sys.modules)))
"""


@pytest.mark.parametrize("argv", [["stats"], ["list", "ready"],
                                  ["worker", "--drain", "--concurrency", "2"],
                                  ["check", "--json"]])
def test_a_command_in_its_usual_form_imports_no_argparse(tmp_path, argv):
    """A worker's start and an operator's command parse without argparse
    (its import and the parser were a fifth of a `myq stats`); --help
    still has it."""
    spool = str(tmp_path / "spool")
    myq.open_store(spool).init()
    py = [p[1] for p in PYTHONS][0]
    for words, want in ((argv, ""), (argv + ["--help"], "argparse gettext")):
        cp = subprocess.run([py, "-I", "-S", "-c", COMMAND_IMPORTS, ROOT, spool]
                            + words, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, universal_newlines=True,
                            env=clean_env(), timeout=120)
        rc, _, got = cp.stdout.strip().splitlines()[-1].partition(" ")
        assert got == want, (words, cp.stdout, cp.stderr)


def _plain_by_re(text, more=None):
    sub = lambda m: "\\x%02x" % ord(m.group())     # noqa: E731
    text = re.sub(u"[\x00-\x1f\x7f-\x9f]", sub, str(text))
    return re.sub(more, sub, text) if more is not None else text


@settings(max_examples=1500, deadline=None)
@given(st.text(alphabet=u"ab=, \t\n\x00\x1b\x7f\x85\x9f\xa0\u2028\u3000é\U0001F600",
               max_size=8), st.booleans())
def test_plain_is_its_expressions(text, field):
    """_plain's shortcut (a printable text, none of _FIELD's characters)
    answers what its expressions answer."""
    more = myq._FIELD if field else None
    assert myq._plain(text, more) == _plain_by_re(text, r"[\s,=]" if field else None)


def test_myq_stats_imports_no_re(tmp_path):
    """The operator's most frequent command: its status line's fields are
    checked without re (26 M instructions of its 77 M)."""
    spool = str(tmp_path / "spool")
    myq.open_store(spool).init()
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import myq; "
            "rc = myq.main(['--spool', sys.argv[2], 'stats']); "
            "print(rc, 're' in sys.modules)")
    cp = subprocess.run([[p[1] for p in PYTHONS][0], "-I", "-S", "-c", code,
                         ROOT, spool], stdout=subprocess.PIPE,
                        universal_newlines=True, env=clean_env(), timeout=120)
    assert cp.stdout.strip().splitlines()[-1] == "0 False", cp.stdout


@settings(max_examples=1500, deadline=None)
@given(st.text(alphabet=u"ab09=\"\\ \t\x00\x7f!~é\xa0", max_size=6))
def test_bare_is_its_expression(value):
    """A log value stands bare where the expression it replaced said so."""
    assert myq._bare(value) == bool(
        re.match(r"[\x21\x23-\x3c\x3e-\x5b\x5d-\x7e]+\Z", value))


QUICK_EVERYWHERE = r"""
import random, sys
sys.path.insert(0, sys.argv[1])
import myq

def argparse_says(argv):
    try:
        return repr(sorted(vars(myq._parser().parse_args(argv)).items()))
    except BaseException as e:
        return type(e).__name__

random.seed(7)
samples = ["3", "5s", "1M", "true", "t", "a=b", "dead", "sqlite", "x.json",
           "--spool", "S", "-", "--", "--help", "-1"]
asked = quick = 0
for name in sorted(myq._COMMAND_TABLE):
    p = myq._parser(name)._subparsers._group_actions[0].choices[name]
    words = [a.option_strings[0] for a in p._actions
             if a.option_strings and a.dest != "help"] + samples
    for _ in range(40):
        argv = [name] + [random.choice(words) for _ in range(random.randint(0, 6))]
        got = myq._quick_args(argv)
        asked += 1
        if got is not None:
            quick += 1
            assert repr(sorted(vars(got).items())) == argparse_says(argv), argv
print(asked, quick)
"""


@pytest.mark.parametrize("py", [p[1] for p in PYTHONS], ids=IDS)
def test_quick_args_are_each_pythons_argparse(py):
    """argparse differs between Pythons (its matching of positionals, its
    defaults): on each, the quick parse answers as its own argparse."""
    cp = subprocess.run([py, "-c", QUICK_EVERYWHERE, ROOT],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        universal_newlines=True, env=clean_env(), timeout=300)
    assert cp.returncode == 0, cp.stderr[-2000:]
    asked, quick = map(int, cp.stdout.split())
    assert quick > asked // 5, cp.stdout
