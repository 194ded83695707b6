FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY harvest ./harvest
RUN pip install --no-cache-dir '.[ops]'
# This deployment's Celery app (`celery -A workers`): a thin module over harvest.worker.
COPY workers ./workers
USER nobody
