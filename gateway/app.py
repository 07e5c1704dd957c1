"""The FastAPI app factory."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response

from auth.access import AccessPolicy, OpenAccess
from auth.factory import build_access
from backends.base import Backend
from backends.embeddings import task_of
from backends.registry import create_backend
from gateway.admin.routes import router as admin_router
from gateway.anthropic.routes import router as messages_router
from gateway.browser_guard import BrowserGuardMiddleware, BrowserPolicy, listens_on_loopback
from gateway.drain import Drain, DrainMiddleware
from gateway.embeddings.routes import router as embeddings_router
from gateway.error_shapes import shaped_response
from gateway.errors import install_error_handlers
from gateway.generation import ClientDisconnected
from gateway.limits import BodyLimitMiddleware
from gateway.metrics import GatewayMetrics
from gateway.middleware import CLIENT_CLOSED, MetricsMiddleware, set_status_label
from gateway.models_file import DeploymentPlan, ModelPlan
from gateway.ollama.catalog import open_router as ollama_open_router
from gateway.ollama.catalog import router as ollama_models_router
from gateway.ollama.embed import router as ollama_embed_router
from gateway.ollama.routes import router as ollama_router
from gateway.openai.models import router as models_router
from gateway.openai.routes import router as openai_router
from gateway.openai.tokenize_routes import router as tokenize_router
from gateway.openapi import install_openapi
from gateway.playground import router as playground_router
from gateway.response_headers import ResponseHeadersMiddleware
from gateway.responses_api.routes import router as responses_router
from gateway.responses_api.stores import STATE_ATTR as RESPONSES_STORE
from gateway.responses_api.stores import open_store
from gateway.service_routes import router as service_router
from gateway.settings import Settings
from gateway.state import GatewayState
from gateway.tgi.routes import router as tgi_router
from routing.deployment import Deployment
from routing.health import HealthChecker
from routing.registry import ModelRegistry

log = logging.getLogger("switchyard.gateway")
Served = Backend | Sequence[Deployment]  # one backend, or a model's deployments


def _deployment(plan: DeploymentPlan) -> Deployment:
    return Deployment(plan.name, create_backend(plan.spec), plan.weight, plan.priority)


def build_registry(settings: Settings, backends: Mapping[str, Served] | None) -> ModelRegistry:
    """Given backends (or deployments) by served name, or else the ones the settings declare."""
    registry = ModelRegistry(settings.routing_policy())
    plans = settings.model_plans()
    if backends is None:
        for plan in plans:
            deployments = [_deployment(d) for d in plan.deployments]
            registry.add_model(plan.name, deployments, plan.aliases, plan.tool_call_parser,
                               plan.sampling_defaults, plan.task)
        return registry
    declared = {plan.name: plan for plan in plans}
    for name, served in backends.items():
        deployments = served if isinstance(served, Sequence) else [Deployment(name, served)]
        # Undeclared, a model has the task its backend was built for.
        task = task_of(deployments[0].backend, settings.task)
        plan = declared.get(name) or ModelPlan(name, (), (), None, settings.flag_sampling(),
                                               task)
        registry.add_model(name, deployments, plan.aliases, plan.tool_call_parser,
                           plan.sampling_defaults, plan.task)
    return registry


async def start_backends(registry: ModelRegistry) -> list[Backend]:
    started: list[Backend] = []
    names: dict[int, str] = {}
    for model, d in registry.deployments():
        names.setdefault(id(d.backend), f"{model} ({d.name})")
    try:
        for backend in registry.backends():
            began = time.perf_counter()
            log.info("starting model %s ...", names[id(backend)])
            await backend.start()
            started.append(backend)
            registry.backend_started(backend)
            log.info("model %s ready in %.1fs", names[id(backend)], time.perf_counter() - began)
    except BaseException:
        await close_backends(started)
        raise
    return started


async def close_backends(backends: list[Backend]) -> None:
    for backend in reversed(backends):
        try:
            await backend.close()
        except Exception:
            log.exception("closing a backend failed")


@asynccontextmanager
async def _loading_in_background(
    registry: ModelRegistry, on_failure: Callable[[BaseException], None] | None,
    on_loaded: Callable[[], None] | None,
) -> AsyncIterator[None]:
    task = asyncio.create_task(start_backends(registry))

    def report(done: asyncio.Task[list[Backend]]) -> None:
        if done.cancelled():
            return
        if done.exception() is None:
            if on_loaded is not None:
                on_loaded()
            return
        log.error("a model could not be loaded: %s", done.exception())
        if on_failure is not None:
            on_failure(done.exception())

    task.add_done_callback(report)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        await close_backends(list(registry.backends()))


@asynccontextmanager
async def _checking(checker: HealthChecker) -> AsyncIterator[None]:
    """The routing health checker runs while the app serves."""
    checker.start()
    try:
        yield
    finally:
        await checker.stop()


async def _client_disconnected(request: Request, exc: Exception) -> Response:
    set_status_label(request.scope, CLIENT_CLOSED)
    return Response(status_code=CLIENT_CLOSED)


def create_app(
    settings: Settings, backends: Mapping[str, Served] | None = None,
    access: AccessPolicy | None = None, *, load_in_background: bool = False,
    on_load_failure: Callable[[BaseException], None] | None = None,
    on_loaded: Callable[[], None] | None = None,
) -> FastAPI:
    """The gateway app. `backends` (one backend, or a list of `Deployment`s) by served
    model name; None builds them from `settings` (the models file's deployments).

    Backends are started (models loaded) in the lifespan and closed on shutdown. By
    default loading finishes before the server accepts connections; with
    `load_in_background` the server answers at once (/health 503 until every model
    is ready), `on_load_failure` hears of a model that could not load and `on_loaded`
    of every model ready.
    """
    registry = build_registry(settings, backends)
    state = GatewayState(
        settings=settings, models=registry,
        metrics=GatewayMetrics(
            lambda: [(m.name, m.router) for m in registry.models()],
            deployments=registry.deployments,
        ),
        access=access or build_access(settings.auth_config()),
    )
    checker = HealthChecker(registry.deployments, registry.policy)
    responses = open_store(settings)  # opens or connects on first use

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.access.announce()
        await state.access.start()
        try:
            if load_in_background:
                loading = _loading_in_background(registry, on_load_failure, on_loaded)
                async with loading, _checking(checker):
                    yield
            else:
                started = await start_backends(registry)
                try:
                    async with _checking(checker):
                        yield
                finally:
                    await close_backends(started)
        finally:
            await responses.close()
            await state.access.close()

    app = FastAPI(title="Switchyard", version="0.1.0", lifespan=lifespan)
    app.state.gateway = state
    app.state.health_checker = checker
    setattr(app.state, RESPONSES_STORE, responses)
    install_error_handlers(app, shaped_response)
    app.add_exception_handler(ClientDisconnected, _client_disconnected)
    app.state.drain = Drain()
    app.add_middleware(ResponseHeadersMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_body_bytes)
    origins = settings.cors_origins()
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=sorted(origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["*"])
    app.add_middleware(BrowserGuardMiddleware, policy=BrowserPolicy(
        open_mode=isinstance(state.access, OpenAccess), allowed_origins=origins,
        loopback_only=listens_on_loopback(settings.hostname)))
    app.add_middleware(DrainMiddleware, drain=app.state.drain)
    app.add_middleware(MetricsMiddleware, metrics=state.metrics)
    app.include_router(service_router)
    app.include_router(openai_router)
    app.include_router(messages_router)
    app.include_router(responses_router)
    app.include_router(ollama_router)
    app.include_router(ollama_embed_router)
    app.include_router(ollama_models_router)
    app.include_router(ollama_open_router)
    app.include_router(embeddings_router)
    app.include_router(tokenize_router)
    app.include_router(models_router)
    app.include_router(admin_router)
    app.include_router(tgi_router)
    if settings.playground:
        app.include_router(playground_router)  # a static page; its API calls carry the key
    install_openapi(app)
    return app
