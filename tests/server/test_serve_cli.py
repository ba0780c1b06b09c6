"""``quickdraft serve`` flags, without starting anything: how the batch-size threshold of
speculation is chosen."""

from __future__ import annotations

import pytest

from quickdraft.commands.cli import build_parser
from quickdraft.server.cli import DEFAULT_DISABLE_BY_BATCH_SIZE, speculative_config

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3}'
FIXED = '{"method": "ngram", "num_speculative_tokens": 3, "adaptive": false}'


@pytest.mark.parametrize("argv, expected", [
    ([], None),  # no speculation: nothing to turn off
    (["--speculative-config", NGRAM], None),  # adaptive: the plan turns speculation off when it stops paying
    (["--speculative-config", FIXED], DEFAULT_DISABLE_BY_BATCH_SIZE),
    (["--speculative-config", NGRAM, "--speculative-disable-by-batch-size", "3"], 3),
    (["--speculative-config", NGRAM, "--speculative-disable-by-batch-size", "0"], None),  # 0: never
    (["--speculative-config", '{"method": "ngram", "disable_by_batch_size": 5}'], 5),
    (["--speculative-config", '{"method": "ngram", "disable_by_batch_size": null}'], None),
])
def test_disable_by_batch_size(argv, expected):
    args = build_parser().parse_args(["serve", *argv])
    spec = speculative_config(args)
    assert spec.disable_by_batch_size == expected


def test_serve_defaults():
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.max_num_seqs, args.max_queue) == ("127.0.0.1", 8000, 8, 64)
    assert args.api_key is None and args.served_model_name is None
