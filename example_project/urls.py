from django.contrib import admin
from django.urls import path

from . import views

urlpatterns = [
    path("", views.home, name="home"),
    path("api/hit/<str:name>/", views.hit, name="hit"),
    path("admin/", admin.site.urls),
]
