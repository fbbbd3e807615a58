"""Admin and the shop's views."""

from django.contrib import admin
from django.urls import path

from tests.django_project.shop import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("shop/orders/", views.place_order, name="place-order"),
    path("checkout/", views.checkout, name="checkout"),
]
