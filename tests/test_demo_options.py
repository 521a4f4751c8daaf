"""``performer-hf demo``'s options: counts the demo cannot run with, and a method it cannot convert with, end at once
in a usage error (before, in a traceback from deep inside, after the conversion and the embedding comparison, or in
a silent "all but one sentence"); ``run_demo`` refuses the same counts before any work."""

import pytest

import performer_hf_cli
from performer_hf.conversion import demo
from performer_hf.conversion.convert import METHODS
from performer_hf.conversion.errors import ConversionError
from performer_hf_cli.options import METHODS as CLI_METHODS


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--repeats", "0"], "argument --repeats: expected a whole number >= 1, got 0"),
        (["--length", "0"], "argument --length: expected a whole number >= 2, got 0"),
        (["--length", "1"], "argument --length: expected a whole number >= 2, got 1"),
        (["--sentences", "0"], "argument --sentences: expected a whole number >= 3, got 0"),
        (["--sentences", "-1"], "argument --sentences: expected a whole number >= 3, got -1"),
        (["--sentences", "2"], "argument --sentences: expected a whole number >= 3, got 2"),
        (["--repeats", "many"], "argument --repeats: expected a whole number, got 'many'"),
        (["--method", "sparse"], "argument --method: invalid choice: 'sparse'"),
    ],
)
def test_bad_options_end_in_one_usage_line(flags, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        performer_hf_cli.main(["demo", *flags])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and message in error, error


def test_the_least_counts_and_every_encoder_method_parse():
    args = performer_hf_cli.parser().parse_args(["demo", "--length", "2", "--sentences", "3", "--repeats", "1"])
    assert (args.length, args.sentences, args.repeats, args.method) == (2, 3, 1, None)
    for method in CLI_METHODS:  # the demo converts an encoder: the methods with a bidirectional preset, no other
        if "bidirectional" in METHODS[method]:
            assert performer_hf_cli.parser().parse_args(["demo", "--method", method]).method == method
        else:
            with pytest.raises(SystemExit):
                performer_hf_cli.parser().parse_args(["demo", "--method", method])


@pytest.mark.parametrize(
    "settings, name", [({"length": 0}, "length"), ({"num_sentences": -1}, "num_sentences"), ({"repeats": 0}, "repeats")]
)
def test_run_demo_refuses_bad_counts_before_any_work(settings, name, monkeypatch):
    monkeypatch.setattr(demo, "minilm_folder", lambda: pytest.fail("the demo started its work"))
    with pytest.raises(ConversionError, match=f"the demo's {name} must be a whole number >= "):
        demo.run_demo(**settings)
