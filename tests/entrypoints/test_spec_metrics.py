"""GET /metrics' speculative decoding counters: absent without speculation, then fed from the
scheduler's running totals snapshot after snapshot (never counted twice)."""

from metrale.engine.async_engine import EngineSnapshot
from metrale.engine.spec_stats import SpecDecodeStats
from metrale.entrypoints.server.metrics import ServerMetrics


def sample(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_spec_decode_counters_follow_the_totals():
    metrics = ServerMetrics("m")
    metrics.on_snapshot(EngineSnapshot())
    assert "spec_decode" not in metrics.render().decode()
    totals = SpecDecodeStats()
    totals.record(3, 2)
    metrics.on_snapshot(EngineSnapshot(spec_decode=totals.copy()))
    totals.record(3, 0)
    metrics.on_snapshot(EngineSnapshot(spec_decode=totals.copy()))
    metrics.on_snapshot(EngineSnapshot(spec_decode=totals.copy()))
    text = metrics.render().decode()
    assert sample(text, "met:spec_decode_num_drafts_total") == 2
    assert sample(text, "met:spec_decode_num_draft_tokens_total") == 6
    assert sample(text, "met:spec_decode_num_accepted_tokens_total") == 2
    assert 'met:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 1.0' in text
    assert 'met:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 0.0' in text
    assert totals.acceptance_rate == 2 / 6 and totals.mean_accepted_length == 2.0
