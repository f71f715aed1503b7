"""The table of the textbook token bucket: tokens and the time they were counted, per key."""

from __future__ import annotations

from django.db import models


class Bucket(models.Model):
    key = models.CharField(max_length=200, unique=True)
    tokens = models.FloatField()
    updated = models.FloatField()

    class Meta:
        app_label = "textbook"

    def __str__(self) -> str:
        return f"{self.key}: {self.tokens:g}"
