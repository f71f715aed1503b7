from django.urls import path

from . import api, views

urlpatterns = [
    path("", views.home, name="home"),
    path("api/quotes/", api.QuoteView.as_view(), name="quotes"),
    path("login/", views.login_view, name="login"),
    path("convert/", views.convert, name="convert"),
    path("summaries/", views.summaries, name="summaries"),
    path("summaries/jobs.json", views.summary_jobs, name="summary-jobs"),
    path("playground/", views.playground, name="playground"),
    path("playground/api/<str:name>/", views.playground_status, name="playground-status"),
    path("playground/api/<str:name>/hit/", views.playground_hit, name="playground-hit"),
    path("playground/api/<str:name>/reset/", views.playground_reset, name="playground-reset"),
]
