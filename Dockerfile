# The rtrl image: every service (`rtrl serve gateway|ingest|reward|trainer|deployer`) and the
# operator CLI. CPU-only torch; runs as the non-root user 10001 that the Helm chart expects.
#   docker build -t rtrl:0.1.0 .
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/rtrl
ENV PATH=/opt/rtrl/bin:$PATH
# torch first, from PyTorch's CPU index: the default wheel pulls in several GB of CUDA.
# 2.13.0+cpu satisfies the project's exact pin torch==2.13.0.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY pyproject.toml README.md ./src/
COPY services ./src/services
COPY ingest ./src/ingest
COPY trainer ./src/trainer
COPY deployer ./src/deployer
COPY rollback ./src/rollback
COPY bench ./src/bench
RUN pip install ./src

FROM python:3.11-slim
RUN groupadd --gid 10001 rtrl \
 && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin rtrl
COPY --from=build /opt/rtrl /opt/rtrl
ENV PATH=/opt/rtrl/bin:$PATH \
    HOME=/tmp \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    MLFLOW_DISABLE_TELEMETRY=true \
    RAY_USAGE_STATS_ENABLED=0 \
    RTRL_HTTP__HOST=0.0.0.0 \
    RTRL_HTTP__PORT=9100
# The root filesystem can stay read-only: everything writable lives under /tmp.
WORKDIR /tmp
USER 10001:10001
EXPOSE 8080 9100
ENTRYPOINT ["rtrl"]
CMD ["--help"]
