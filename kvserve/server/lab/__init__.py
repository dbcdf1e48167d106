"""The lab: a live KV block map, a memory calculator, cached-vs-recomputed steps and a prefix-cache
explainer, served under /lab by `kvserve serve` itself (static pages, no build step, no CDN)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from kvserve.engine.async_engine import AsyncEngine
from kvserve.server.core.serving import Serving
from kvserve.server.lab.access import LabAccess
from kvserve.server.lab.feed import FeedSettings
from kvserve.server.lab.recent import RecentRequests
from kvserve.server.lab.routes import STATIC_DIR, lab_router
from kvserve.server.lab.steps import StepsLimits, StepsRunner


def mount_lab(app: FastAPI, async_engine: AsyncEngine, serving: Serving, feed: FeedSettings | None = None,
              steps_limits: StepsLimits | None = None) -> None:
    """Add the lab's pages, static files and data routes to `app`, and start keeping recent requests."""
    settings = serving.settings
    access = LabAccess(settings.admin_key, settings.api_keys)
    recent = RecentRequests(keep_prompts=settings.log_prompts)
    async_engine.observers.append(recent.observe)
    steps = StepsRunner(async_engine.engine, steps_limits or StepsLimits())
    app.include_router(lab_router(async_engine, serving, access, recent, steps, feed or FeedSettings()))
    app.mount("/lab/static", StaticFiles(directory=STATIC_DIR), name="lab-static")
