"""GenerationOptions: the one place sampling and stopping options are checked. Every option's invalid
values raise InputError naming it (from the object, from Model.generate, as the server's 400 `param`);
the CLI, the server and Model.generate build the same options from the same inputs; generation_config.json
fills what is unset."""
import argparse
import dataclasses

import numpy as np
import pytest

import qwenmetal as qm
from qwenmetal import cli, serving
from qwenmetal.errors import InputError
from qwenmetal.options import GenerationOptions
from qwenmetal.testing import cached_checkpoint

# (option, an invalid value, what the message says)
BAD = [
    ("max_tokens", 0, "max_tokens must be an integer >= 1"), ("max_tokens", 2.5, "max_tokens must be an integer"),
    ("max_tokens", True, "max_tokens must be an integer"),
    ("temperature", -0.1, "temperature must be >= 0"), ("temperature", "hot", "temperature must be a finite number"),
    ("temperature", float("nan"), "temperature must be a finite number"),
    ("top_k", -2, r"top_k must be >= 0"), ("top_k", 1.5, "top_k must be an integer"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"), ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
    ("min_p", -0.5, r"min_p must be in \[0, 1\]"), ("min_p", 2, r"min_p must be in \[0, 1\]"),
    ("repetition_penalty", 0, "repetition_penalty must be > 0"),
    ("presence_penalty", "x", "presence_penalty must be a finite number"),
    ("frequency_penalty", float("inf"), "frequency_penalty must be a finite number"),
    ("seed", 1.5, "seed must be an integer or None"), ("seed", False, "seed must be an integer or None"),
    ("seed", -1, r"seed must be >= 0 \(or None\), got -1"),
    ("stop", [3], "stop must be a string or a list of strings"), ("stop", "", "stop strings must be non-empty"),
    ("stop", ["a", ""], "stop strings must be non-empty"),
    ("stop_token_ids", 5, "stop_token_ids must be a list of integers"),
    ("stop_token_ids", [1, -1], "stop_token_ids must be an integer >= 0"),
    ("stop_token_ids", ["7"], "stop_token_ids must be an integer"),
    ("ignore_eos", "yes", "ignore_eos must be a boolean"), ("logprobs", 1, "logprobs must be a boolean"),
    ("top_logprobs", -1, "top_logprobs must be an integer >= 0"),
    ("skip_special_tokens", 0, "skip_special_tokens must be a boolean"),
]


@pytest.fixture(scope="module")
def model():
    m = qm.Model.load(cached_checkpoint("tiny", "mlx-q4"), backend="reference")
    m.prefix_cache = None
    return m


@pytest.mark.parametrize("name,value,message", BAD)
def test_each_option_is_checked_and_named(name, value, message, model):
    with pytest.raises(InputError, match="^" + message) as e:      # the message starts with the option's name
        GenerationOptions(**{name: value})
    assert e.value.param == name and isinstance(e.value, ValueError)
    with pytest.raises(InputError, match=message):        # Model.generate: before any work
        model.generate("abc", **{name: value})
    ok = GenerationOptions()
    with pytest.raises(InputError, match=message):        # replace() checks again
        dataclasses.replace(ok, **{name: value})


def test_normalised_and_immutable():
    o = GenerationOptions(stop="x", stop_token_ids=[3, 4], top_k=5.0, temperature=1)
    assert o.stop == ("x",) and o.stop_token_ids == (3, 4) and o.top_k == 5 and isinstance(o.top_k, int)
    assert o.temperature == 1.0 and o.sampling == {"temperature": 1.0, "top_k": 5}
    with pytest.raises(dataclasses.FrozenInstanceError, match="temperature"):
        o.temperature = 3
    with pytest.raises(TypeError, match="unknown generation option.*tempreature"):
        GenerationOptions.build(tempreature=0.5)
    with pytest.raises(InputError, match="options must be a GenerationOptions"):
        GenerationOptions.build({"temperature": 0.5})
    # None overrides keep the field; given ones replace it
    assert GenerationOptions.build(o, temperature=None, seed=3) == dataclasses.replace(o, seed=3)


def test_counts_become_ints_and_none_lists_empty():
    o = GenerationOptions(max_tokens=np.int64(5), top_logprobs=np.int32(2), stop=None, stop_token_ids=None)
    assert (o.max_tokens, o.top_logprobs, o.stop, o.stop_token_ids) == (5, 2, (), ())
    assert type(o.max_tokens) is int and type(o.top_logprobs) is int


def test_build_names_what_is_wrong():
    with pytest.raises(InputError, match="^options must be a GenerationOptions, got dict$") as e:
        GenerationOptions.build({"temperature": 0.5})
    assert e.value.param == "options"
    with pytest.raises(TypeError, match=r"^unknown generation option\(s\): seeed, tempreature$"):
        GenerationOptions.build(tempreature=0.5, seeed=1)


def test_generation_config_fills_what_is_unset():
    g = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "do_sample": True, "max_new_tokens": 9}
    o = GenerationOptions(temperature=0.2).with_defaults(g)
    assert (o.temperature, o.top_k, o.top_p, o.min_p) == (0.2, 20, 0.95, None)
    assert GenerationOptions().with_defaults({"do_sample": False, "temperature": 0.9}).temperature == 0.0
    assert GenerationOptions().with_defaults(None) == GenerationOptions()
    with pytest.raises(InputError, match="top_p must be in"):          # a checkpoint's bad default is named too
        GenerationOptions().with_defaults({"top_p": 7})
    s = GenerationOptions(seed=4).sampler(g)
    assert (s.temperature, s.top_k, s.top_p, s.seed) == (0.6, 20, 0.95, 4)


def _cli_options(argv):
    p = argparse.ArgumentParser()
    cli._add_sampling_args(p)
    p.add_argument("--ignore-eos", action="store_true")
    return GenerationOptions.from_cli_args(p.parse_args(argv))


def test_cli_server_and_generate_build_the_same_options(model, monkeypatch):
    want = GenerationOptions(max_tokens=12, temperature=0.7, top_k=40, top_p=0.9, min_p=0.05,
                             repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=-0.5, seed=123,
                             stop=("\n\n", "END"), ignore_eos=True)
    got_cli = _cli_options(["--max-tokens", "12", "--temperature", "0.7", "--top-k", "40", "--top-p", "0.9",
                            "--min-p", "0.05", "--repetition-penalty", "1.1", "--presence-penalty", "0.5",
                            "--frequency-penalty", "-0.5", "--seed", "123", "--stop", "\\n\\n", "--stop", "END",
                            "--ignore-eos"])
    body = {"max_tokens": 12, "temperature": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.05,
            "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": -0.5, "seed": 123,
            "stop": ["\n\n", "END"], "ignore_eos": True}
    got_server = serving.options_of(body, 12)
    seen = []
    monkeypatch.setattr("qwenmetal.generation.generate", lambda m, prompt, opts, **kw: seen.append(opts))
    model.generate("x", **body)
    assert got_cli == got_server == seen[0] == want
    # the defaults agree too (nothing set: everything from generation_config.json)
    assert _cli_options(["--max-tokens", "256"]) == serving.options_of({}, 256) == GenerationOptions()
    assert serving.options_of({"top_k": -1}, 5).top_k == 0                 # vLLM's "off"
    p = argparse.ArgumentParser()                                       # a command without --ignore-eos
    cli._add_sampling_args(p)
    assert GenerationOptions.from_cli_args(p.parse_args(["--max-tokens", "7"])) == GenerationOptions(max_tokens=7)


JSON_BAD = [b for b in BAD if b[0] not in ("max_tokens", "logprobs", "top_logprobs", "skip_special_tokens")
            and b[1] == b[1] and b[1] != float("inf")           # the request fields, with JSON values
            and (b[0], b[1]) != ("seed", -1)]                   # the server takes any JSON integer as a seed


@pytest.mark.parametrize("name,value,message", JSON_BAD)
def test_server_reports_the_option_as_param(name, value, message):
    with pytest.raises(serving.APIError, match=message) as e:
        serving.options_of({name: value}, 5)
    assert e.value.status == 400 and e.value.param == name


def test_server_keeps_openai_ranges():
    for name, value in (("temperature", 2.5), ("presence_penalty", -3), ("frequency_penalty", 2.1)):
        with pytest.raises(serving.APIError, match=f"'{name}' must be in") as e:
            serving.options_of({name: value}, 5)
        assert e.value.param == name
    with pytest.raises(serving.APIError, match="at most 16 strings") as e:
        serving.options_of({"stop": ["x"] * 17}, 5)
    assert e.value.param == "stop"


def test_sampler_and_sampling_options_together_is_an_error(model):
    with pytest.raises(ValueError, match="either a sampler or sampling options.*seed, temperature"):
        model.generate("abc", sampler=qm.Sampler(), options=GenerationOptions(temperature=0.5), seed=2)
    # stopping options go with a sampler
    outs = list(model.generate("abc", sampler=qm.Sampler(), options=GenerationOptions(max_tokens=3, ignore_eos=True)))
    assert len(outs) == 3


def test_options_and_keywords_generate_the_same(model):
    o = GenerationOptions(max_tokens=6, temperature=0.9, seed=5, ignore_eos=True)
    a = [x.token for x in model.generate("abc", options=o)]
    b = [x.token for x in model.generate("abc", max_tokens=6, temperature=0.9, seed=5, ignore_eos=True)]
    c = [x.token for x in model.generate("abc", options=dataclasses.replace(o, seed=1), seed=5)]
    assert a == b == c and len(a) == 6
