from django.contrib import admin
from django.urls import include, path
from rest_framework.routers import SimpleRouter

from . import views

router = SimpleRouter()
router.register("things", views.Things, basename="things")

urlpatterns = [
    path("inline-ip/", views.inline_ip),
    path("login/", views.login),
    path("stacked/", views.stacked),
    path("soft/", views.soft),
    path("dotted/", views.by_dotted_path),
    path("exemptable/", views.exemptable),
    path("weighted/", views.weighted),
    path("async/", views.async_view),
    path("async/user/", views.async_by_user),
    path("async/stacked/", views.async_stacked),
    path("async/weighted/", views.async_weighted),
    path("async/awaited/", views.async_awaited_key),
    path("shadowed/", views.shadowed),
    path("raises/", views.raises),
    path("class/", views.ClassView.as_view()),
    path("method/", views.MethodDecorated.as_view()),
    path("keyed-by-pk/", views.keyed_by_pk),
    path("global-budget/", views.global_budget),
    path("probe/", views.unavailable_probe),
    path("api/default/", views.DefaultThrottled.as_view()),
    path("api/two/", views.TwoThrottles.as_view()),
    path("api/inside/", views.LimitedInside.as_view()),
    path("api/burst/", views.BurstSustained.as_view()),
    path("api/costly/", views.Costly.as_view()),
    path("api/function/", views.function_api),
    path("api/", include(router.urls)),
    path("admin/", admin.site.urls),
]
