"""The consolidations router: a store's consolidation jobs (start, list) and one job (read,
cancel); docs/API.md, "Consolidation jobs"."""
from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import Response

from memfuse.defs import JOBS_PAGE_DEFAULT, JOBS_PAGE_MAX
from memfuse.models import ConsolidationCreate, ConsolidationJob
from memfuse.server import routetable as table
from memfuse.server.routes.deps import JobId, P, StoreSlug, Svc, json_response, route
from memfuse.server.problems import PROBLEM_RESPONSES

router = APIRouter(responses=PROBLEM_RESPONSES)  # the problem+json answers every operation may give


@route(router, table.CREATE_CONSOLIDATION, status_code=202, response_model=ConsolidationJob,
       tags=["consolidations"])
def create_consolidation(svc: Svc, store: StoreSlug, body: ConsolidationCreate, p: P) -> Response:
    """Start a consolidation job on the store (docs/API.md, "Consolidation jobs"): 202
    with the job, ``Location`` its URL."""
    job = svc.create_consolidation(p, store, body)
    return Response(content=job.model_dump_json(), status_code=202, media_type="application/json",
                    headers={"Location": table.GET_CONSOLIDATION.url(job_id=job.id)})


@route(router, table.LIST_CONSOLIDATIONS, response_model=list[ConsolidationJob], tags=["consolidations"])
def list_consolidations(
    svc: Svc,
    store: StoreSlug, p: P,
    limit: Annotated[int, Query(ge=1, le=JOBS_PAGE_MAX, description="jobs to list at most")] = JOBS_PAGE_DEFAULT,
) -> Response:
    """The store's consolidation jobs, newest first."""
    return json_response(svc.list_consolidations(p, store, limit))


@route(router, table.GET_CONSOLIDATION, response_model=ConsolidationJob, tags=["consolidations"])
def get_consolidation(svc: Svc, job_id: JobId, p: P) -> Response:
    """One consolidation job."""
    return json_response(svc.get_consolidation(p, job_id))


@route(router, table.CANCEL_CONSOLIDATION, response_model=ConsolidationJob, tags=["consolidations"])
def cancel_consolidation(svc: Svc, job_id: JobId, p: P) -> Response:
    """Cancel a pending or running job: it writes nothing (409 ``job_finished`` once ended)."""
    return json_response(svc.cancel_consolidation(p, job_id))
