"""The complete `vllm serve` command lines of docs/vllm.md parse as vLLM's own `vllm serve`
parses them (its CLI's serve subcommand, argument validation and EngineArgs, from the installed
vLLM), and kvpeer's tier takes every key of their `secondary_tiers` entry."""

import pathlib
import shlex

import pytest

DOC = pathlib.Path(__file__).parents[2] / "docs" / "vllm.md"
MARKERS = ("gpu-engine", "fleet-sources")


def command(marker: str) -> list[str]:
    """The words of the ```bash block right after `<!-- vllm-serve: marker -->`."""
    text = DOC.read_text()
    after = text.split(f"<!-- vllm-serve: {marker} -->\n", 1)[1]
    assert after.startswith("```bash\n"), f"{marker}: no bash block right after the marker"
    block = after[len("```bash\n"):].split("```", 1)[0]
    return shlex.split(block.replace("\\\n", " "))


def vllm_serve(argv: list[str]):
    """Parses `argv` as `vllm serve ...` does: vLLM's CLI parser with its serve subcommand,
    the subcommand's validation, then EngineArgs (where --kv-transfer-config becomes a
    KVTransferConfig)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    commands = {}
    for cmd in serve.cmd_init():
        cmd.subparser_init(subparsers).set_defaults(dispatch_function=cmd.cmd)
        commands[cmd.name] = cmd
    args = parser.parse_args(argv[1:])
    commands[args.subparser].validate(args)
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    return args, AsyncEngineArgs.from_cli_args(args)


@pytest.mark.parametrize("marker", MARKERS)
def test_the_docs_vllm_serve_lines_parse_as_vllm_parses_them(marker):
    import kvpeer.vllm as tier

    argv = command(marker)
    assert argv[:2] == ["vllm", "serve"], argv
    args, engine = vllm_serve(argv)
    assert engine.model == argv[2]
    kv = engine.kv_transfer_config
    assert kv is not None and kv.kv_connector == "OffloadingConnector", kv
    assert kv.kv_role == "kv_both"
    extra = kv.kv_connector_extra_config
    assert extra["spec_name"] == "TieringOffloadingSpec"
    assert int(extra["cpu_bytes_to_use"]) > 0
    [entry] = extra["secondary_tiers"]
    assert entry["type"] == "KvpeerTier" and entry["module_path"] == "kvpeer.vllm"
    known = tier._STOCK_KEYS + tier._KVPEER_KEYS + tier._FLEET_KEYS + tier._FRAMEWORK_KEYS
    unknown = set(entry) - {"type", "module_path"} - set(known)
    assert not unknown, f"{marker}: keys KvpeerTier does not take: {unknown}"
    if marker == "fleet-sources":
        assert entry["sources"] and all(":" in s for s in entry["sources"])
        events = engine.kv_events_config
        assert events is not None and events.enable_kv_cache_events, events
        assert events.publisher == "zmq" and events.replay_endpoint, events


def test_a_wrong_flag_or_bad_json_is_refused_by_the_same_parser():
    # The check can fail: vLLM's parser refuses what it does not know.
    argv = command("gpu-engine")
    with pytest.raises(SystemExit):
        vllm_serve(argv + ["--no-such-flag", "1"])
    broken = [w if not w.startswith("{") else w[:-1] for w in argv]
    with pytest.raises((SystemExit, ValueError)):
        vllm_serve(broken)
