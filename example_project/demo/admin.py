from django.contrib import admin

from .models import SummaryJob


@admin.register(SummaryJob)
class SummaryJobAdmin(admin.ModelAdmin):
    list_display = ["pk", "owner", "status", "tokens_reserved", "tokens_used", "scheduled_for", "ran_at"]
    list_filter = ["status"]
    readonly_fields = ["created_at", "scheduled_for", "ran_at", "finished_at", "reservation"]
