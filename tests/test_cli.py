"""`jdspark generate` end to end on a synthetic checkpoint with a tokenizer."""

import pytest

from jdspark.cli import main


@pytest.mark.slow  # loads and compiles a checkpoint's engine
def test_generate_target_only_prints_text_and_stats(dspark_checkpoint, capsys):
    code = main(["generate", "--model", str(dspark_checkpoint), "--dtype", "float32", "--max-seq-len", "64",
                 "--max-tokens", "6", "--temperature", "0", "--no-speculative", "--stats", "abc"])
    out, err = capsys.readouterr()
    assert code == 0 and len(out.strip()) >= 1 and '"generated_tokens"' in err


def test_generate_errors_exit_2(dspark_checkpoint, capsys, monkeypatch, tmp_path):
    assert main(["generate", "--model", str(dspark_checkpoint), "--no-speculative", "--temperature", "-1", "x"]) == 2
    assert "temperature=-1.0: must be a number >= 0" in capsys.readouterr().err
    monkeypatch.setattr("jdspark.assets.DEFAULT_MODEL", str(tmp_path / "absent"))  # as if not installed
    assert main(["generate", "x"]) == 2
    assert "pass --model PATH" in capsys.readouterr().err


def test_engine_options_are_checked_before_compiling(dspark_checkpoint, capsys):
    common = ["generate", "--model", str(dspark_checkpoint), "--dtype", "float32", "--max-seq-len", "64", "x"]
    assert main([*common, "--widths", "2,7"]) == 2
    assert "widths=(2, 7): each must be in 0..gamma=5" in capsys.readouterr().err
    assert main([*common, "--width", "3", "--widths", "2,5"]) == 2
    assert "width=3: must be one of the compiled widths [2, 5]" in capsys.readouterr().err
    assert main([*common, "--batch-buckets", "1,2"]) == 2  # generate runs one slot
    assert "batch_buckets=(1, 2): each must be an integer in 1..max_batch=1" in capsys.readouterr().err
    assert main([*common, "--prefill-buckets", "1,2"]) == 2
    assert "prefill_batch_buckets=(1, 2): each must be an integer in 1..max_batch=1" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):  # argparse's own exit status for a malformed option
        main([*common, "--widths", "2,a"])
    assert "argument --widths: '2,a': expected comma-separated integers" in capsys.readouterr().err


def test_engine_options_are_checked_before_the_weights_load(dspark_checkpoint, capsys, monkeypatch):
    """What the checkpoint's config.json decides (widths, buckets, the prompt segment) fails before
    `load_model` reads a byte of its weights (minutes for a full-size checkpoint)."""
    def load_model(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr("jdspark.generator.load_model", load_model)
    common = ["--model", str(dspark_checkpoint), "--max-seq-len", "64"]
    assert main(["generate", *common, "--prompt-segment", "8", "x"]) == 2  # generate runs one slot
    assert "prompt_segment=8: needs max_batch >= 2" in capsys.readouterr().err
    assert main(["serve", *common, "--max-running", "4", "--prompt-segment", "65"]) == 2
    err = capsys.readouterr().err
    assert "prompt_segment=65: needs" in err and "max_seq_len = 64" in err
    assert main(["serve", *common, "--max-running", "4", "--prompt-segment", "3"]) == 2
    assert "gamma + 1 = 6" in capsys.readouterr().err
    assert main(["serve", *common, "--widths", "2,7"]) == 2
    assert "widths=(2, 7): each must be in 0..gamma=5" in capsys.readouterr().err
    from jdspark import Generator
    with pytest.raises(TypeError, match="prompt_segmnt"):  # the Python API: a misspelt option's name
        Generator.from_pretrained(dspark_checkpoint, prompt_segmnt=8)
    with pytest.raises(TypeError, match="tokenizer"):  # from_pretrained reads the checkpoint's own
        Generator.from_pretrained(dspark_checkpoint, tokenizer=None)
    with pytest.raises(ValueError, match="implementation='triton'"):
        Generator.from_pretrained(dspark_checkpoint, implementation="triton")


def test_gpu_memory_reaches_the_placement(dspark_checkpoint, capsys):
    """--gpu-memory GB goes to the loader's placement, which refuses less than the weights that are
    not routed experts (they stay on the GPU), before anything compiles."""
    common = ["generate", "--model", str(dspark_checkpoint), "--max-seq-len", "64", "x"]
    assert main([*common, "--gpu-memory", "0.000001"]) == 2
    assert "gpu_memory=1000 bytes is less than the" in capsys.readouterr().err


def test_serve_errors_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("jdspark.assets.DEFAULT_MODEL", str(tmp_path / "absent"))
    assert main(["serve"]) == 2  # the default --model is the embedded one
    assert "embedded model is missing" in capsys.readouterr().err
    assert main(["serve", "--model", str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err


def test_prefill_flags_reach_the_engine(monkeypatch):
    """`--no-prefill-wait`, `--ride-prompts` and `--prompt-segment` reach `Engine.batch_prefills`,
    `Engine.ride_prompts` and the engine's builder through `cli._generator` (the engine itself stood in for: this checks the wiring,
    `tests/engine/test_buckets.py` what the flags do)."""
    import types

    from jdspark import cli
    from jdspark.engine import executables
    from jdspark.engine.options import RIDE_PROMPTS
    from jdspark.generator import Generator
    monkeypatch.setattr(executables, "enable_compile_cache", lambda: None)
    monkeypatch.setattr(Generator, "from_pretrained", classmethod(
        lambda cls, *a, **k: types.SimpleNamespace(engine=types.SimpleNamespace(batch_prefills=True), options=k)))
    parser = cli.build_parser()
    assert cli._generator(parser.parse_args(["serve"])).engine.batch_prefills is True
    assert cli._generator(parser.parse_args(["serve"])).options["prompt_segment"] == 0
    assert cli._generator(parser.parse_args(["serve", "--prompt-segment", "64"])).options["prompt_segment"] == 64
    assert cli._generator(parser.parse_args(["serve", "--no-prefill-wait"])).engine.batch_prefills is False
    assert cli._generator(parser.parse_args(["generate", "--no-prefill-wait", "x"])).engine.batch_prefills is False
    assert cli._generator(parser.parse_args(["serve"])).engine.ride_prompts == RIDE_PROMPTS > 0
    assert cli._generator(parser.parse_args(["serve", "--ride-prompts", "0"])).engine.ride_prompts == 0
    assert cli._generator(parser.parse_args(["serve", "--ride-prompts", "128"])).engine.ride_prompts == 128


def test_serve_defers_speculation_unless_told_not_to(monkeypatch):
    """`jdspark serve` builds its engine with `defer_steps` (target-only serving while the step
    executables build; `tests/engine/test_deferred.py`) unless `--no-defer-speculation`; `_generator`
    hands it to the engine's builder."""
    import types

    from jdspark import cli
    from jdspark.engine import executables
    from jdspark.generator import Generator
    asked = []

    class Stop(Exception):
        pass

    def generator(args, max_batch=1, defer_steps=False):
        asked.append(defer_steps)
        raise Stop

    monkeypatch.setattr(cli, "_generator", generator)
    parser = cli.build_parser()
    for flags, expected in (([], True), (["--no-defer-speculation"], False)):
        with pytest.raises(Stop):
            cli._serve(parser.parse_args(["serve", *flags]))
        assert asked.pop() is expected
    monkeypatch.undo()
    monkeypatch.setattr(executables, "enable_compile_cache", lambda: None)
    monkeypatch.setattr(Generator, "from_pretrained", classmethod(lambda cls, *a, **k: types.SimpleNamespace(
        engine=types.SimpleNamespace(batch_prefills=True), defer_steps=k["defer_steps"])))
    assert cli._generator(parser.parse_args(["serve"]), defer_steps=True).defer_steps is True
    assert cli._generator(parser.parse_args(["generate", "x"])).defer_steps is False
