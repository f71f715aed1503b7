from django.contrib import admin
from django.contrib.auth.views import LogoutView
from django.urls import include, path

urlpatterns = [
    path("", include("example_project.demo.urls")),
    path("logout/", LogoutView.as_view(next_page="home"), name="logout"),
    path("admin/", admin.site.urls),
]
