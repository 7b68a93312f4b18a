"""``refit bench``'s engine formats (``--fp8``, ``--quant mxfp8,nvfp4``): the help, the scenarios one run makes,
and the refusals, each one line naming the flag, before any process starts (in this process, no GPU needed).
The GPU run itself (quantize + pull on S2 against its floors) is bench/gpu_run.sh's."""

import pytest

from refit.tools.bench.harness import BenchOptions, check_formats, check_methods, run_scenarios
from refit.tools.cli import main


def test_bench_help_names_the_formats_and_their_methods(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--quant FMT[,FMT]" in out and "mxfp8,nvfp4" in out and "floor_read_copy" in out and "--fp8" in out


def test_one_run_makes_a_scenario_per_format_with_its_methods():
    opts = BenchOptions(device="cuda", model="llama-3.1-8b", scenarios=("S2",), formats=("fp8", "mxfp8", "nvfp4"))
    got = [(s.name, s.quant, s.methods) for s in run_scenarios(opts)]
    assert got == [
        ("S2-fp8", "fp8", ("refit", "refit_1stage", "fp8_quantize", "floor")),
        ("S2-mxfp8", "mxfp8", ("refit", "refit_1stage", "quantize", "floor")),
        ("S2-nvfp4", "nvfp4", ("refit", "refit_1stage", "quantize", "floor")),
    ]
    check_formats(opts)  # llama-3.1-8b's S2 layouts hold every format
    check_methods(BenchOptions(**{**opts.__dict__, "methods": ("quantize",)}))
    plain = BenchOptions(device="cuda", model="llama-3.1-8b", scenarios=("S2",))
    assert [s.quant for s in run_scenarios(plain)] == [None]


@pytest.mark.parametrize(
    "argv,says",
    [
        (["--quant", "mxfp4"], "--quant: unknown format(s) ['mxfp4']; choose from mxfp8, nvfp4"),
        (["--quant", "fp8"], "--quant: unknown format(s) ['fp8']; choose from mxfp8, nvfp4 (FP8 blocks: --fp8)"),
        (["--quant", ","], "--quant: no format in ','"),
        (["--quant", "nvfp4,mxfp8,nvfp4"], "--quant: format(s) ['nvfp4'] named twice"),
        (["--scenarios", "S1", "--methods", "quantize"], "--methods: unknown method(s) ['quantize']"),
        (
            ["--fp8", "--scenarios", "S3"],
            "--fp8: scenario S3-fp8 with --model tiny-llama: FP8 source: tensor 'model.layers.0.self_attn.q_proj",
        ),
    ],
)
def test_bad_formats_are_refused_in_one_line_naming_the_flag(capsys, argv, says):
    assert main(["bench", "--device", "cpu", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("refit: error: ") and says in err, err
