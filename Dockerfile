FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY harvest ./harvest
COPY workers ./workers
COPY alembic ./alembic
RUN pip install --no-cache-dir -e '.[ops]'
USER nobody
