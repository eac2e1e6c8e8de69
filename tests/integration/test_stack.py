from __future__ import annotations

from pathlib import Path

from services.redis_io import redis_answers
from services.stack import EmbeddedStack, free_port


def test_stack_up_status_down_leaves_no_process(tmp_path: Path) -> None:
    st = EmbeddedStack(data_dir=tmp_path, kafka_port=free_port(), redis_port=free_port(),
                       reuse_redis_url=None, with_mlflow=False)
    st.up(timeout_s=60)
    status = st.status()
    assert status["kafka"].startswith("up") and status["redis"].startswith("up")
    assert (tmp_path / "stack.env").read_text().count("RTRL_") == 2
    pids = [int(v["pid"]) for v in st.state.values() if "pid" in v]
    assert len(pids) == 2
    assert sorted(st.down()) == ["kafka", "redis"]
    assert not redis_answers(st.redis_url)
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_stack_reuses_an_answering_redis(tmp_path: Path, stack: EmbeddedStack) -> None:
    st = EmbeddedStack(data_dir=tmp_path, kafka_port=free_port(), redis_port=free_port(),
                       reuse_redis_url=stack.redis_url, with_mlflow=False)
    st.up(timeout_s=60)
    try:
        assert st.redis_url == stack.redis_url
        assert "reused" in st.status()["redis"]
    finally:
        st.down()
    assert redis_answers(stack.redis_url), "down must not stop a Redis it did not start"


def test_stack_refuses_a_taken_port(tmp_path: Path, stack: EmbeddedStack) -> None:
    import pytest

    st = EmbeddedStack(data_dir=tmp_path, kafka_port=stack.kafka_port, redis_port=free_port(),
                       reuse_redis_url=None, with_mlflow=False)
    with pytest.raises(RuntimeError, match=r"port .* is taken"):
        st.up(timeout_s=10)
    st.down()
