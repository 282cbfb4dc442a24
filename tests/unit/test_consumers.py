"""Consumer configs built from settings: backoff, ack wait and the fetcher's longer wait."""

from __future__ import annotations

from shared import streams
from shared.settings import MeshSettings


def test_the_fetchers_consumers_wait_longer_before_redelivering() -> None:
    settings = MeshSettings()
    assert settings.backoff_s == (2.0, 5.0, 15.0, 30.0) and settings.fetcher_ack_wait_s == 10.0
    fetcher = streams.consumer_config(streams.fetcher_partition(7), settings)
    assert fetcher.backoff == [10.0, 10.0, 15.0, 30.0] and fetcher.ack_wait == 10.0
    assert fetcher.filter_subject == "mesh.frontier.7.>"
    parser = streams.consumer_config(streams.parser_consumer("t1"), settings)
    assert parser.backoff == [2.0, 5.0, 15.0, 30.0] and parser.ack_wait == 2.0
    quick = settings.model_copy(update={"fetcher_ack_wait_s": 1.0})
    assert streams.consumer_backoff(streams.fetcher_partition(0), quick) == (2.0, 5.0, 15.0, 30.0)
