FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md worker.py ./
COPY workflows workflows
COPY activities activities
COPY durable_rlm durable_rlm
COPY migrations migrations
RUN pip install --no-cache-dir ".[postgres,otlp,s3]"
# Sandboxes drop to `nobody`; their root must be traversable.
RUN mkdir -p /tmp/drlm-sandboxes && chmod 711 /tmp/drlm-sandboxes
CMD ["python", "worker.py"]
