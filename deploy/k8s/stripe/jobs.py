import os
import random

import stripe
from celery import Celery

app = Celery("jobs")  # the broker from CELERY_BROKER_URL
stripe.ca_bundle_path = os.environ["STRIPE_CA_BUNDLE"]  # the bundle the init container wrote
client = stripe.StripeClient(os.environ["STRIPE_API_KEY"], max_network_retries=2)


@app.task(bind=True, max_retries=20)
def create_customer(self, email):
    try:
        customer = client.v1.customers.create(params={"email": email})
    except stripe.RateLimitError as err:
        wait = int(err.headers.get("Retry-After", "1"))  # the proxy's, or Stripe's own 429
        raise self.retry(exc=err, countdown=wait + random.uniform(0, 0.2 * wait)) from err
    return customer.id
