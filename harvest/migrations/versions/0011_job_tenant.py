"""fair share per tenant: a nullable ``tenant`` column on harvest_jobs and its claim index

``tenant`` is the job's fairness key (``enqueue(..., tenant="acme")``); NULL is the jobs
without one, which share dispatch as one tenant of their own. Adding a nullable column without
a default is metadata only: no rewrite of a large jobs table.

The fair claim (harvest.store.claim) walks the due tenants with a loose index scan and then
takes each tenant's best jobs in priority order, so the index leads with the tenant (NULL
folded to '' so that one equality finds them; a tenant name is never empty) and then follows
``harvest_jobs_claim_idx``'s order, over pending rows only. Built CONCURRENTLY, outside the
migration's transaction: a busy table keeps taking jobs meanwhile.

Revision ID: 0011_job_tenant
Revises: 0010_job_payload_index
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011_job_tenant"
down_revision = "0010_job_payload_index"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("harvest_jobs", sa.Column("tenant", sa.Text(), nullable=True))
    with op.get_context().autocommit_block():
        op.execute(
            "CREATE INDEX CONCURRENTLY IF NOT EXISTS harvest_jobs_tenant_claim_idx "
            "ON harvest_jobs ((COALESCE(tenant, '')), priority DESC, run_at, id) "
            "WHERE status = 'pending'"
        )


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS harvest_jobs_tenant_claim_idx")
    op.drop_column("harvest_jobs", "tenant")
