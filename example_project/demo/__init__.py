"""The pages of the example project: one realistic use of each integration."""
