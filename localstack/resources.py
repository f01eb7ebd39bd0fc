"""Creates the serverless shape's resources on an emulator (or any AWS endpoint):
the ledger table (as infra/template.yaml declares it) and the audit log group.
Idempotent: what exists is left as it is."""

import os
import sys
import time

import boto3
from botocore.exceptions import ClientError

endpoint = os.environ.get("AWS_ENDPOINT_URL", "http://127.0.0.1:4566")
region = os.environ.get("AWS_REGION", os.environ.get("AWS_DEFAULT_REGION", "us-east-1"))
table = os.environ.get("FLEXWAY_TABLE", "flexway-ledger")
log_group = os.environ.get("FLEXWAY_AUDIT_LOG_GROUP", "/flexway/audit")
session = boto3.session.Session(
    aws_access_key_id=os.environ.get("AWS_ACCESS_KEY_ID", "test"),
    aws_secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY", "test"),
    region_name=region,
)
dynamodb = session.client("dynamodb", endpoint_url=endpoint)
logs = session.client("logs", endpoint_url=endpoint)

try:
    dynamodb.create_table(
        TableName=table,
        KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}],
        AttributeDefinitions=[
            {"AttributeName": "pk", "AttributeType": "S"},
            {"AttributeName": "gsi_expiry_pk", "AttributeType": "S"},
            {"AttributeName": "expires_at", "AttributeType": "N"},
        ],
        # The sweeper's sparse index: only live reservations (and swept ones carrying a
        # settle intent) have gsi_expiry_pk. Same as DynamoDbBudgetStore::create_table.
        GlobalSecondaryIndexes=[
            {
                "IndexName": "expiry",
                "KeySchema": [
                    {"AttributeName": "gsi_expiry_pk", "KeyType": "HASH"},
                    {"AttributeName": "expires_at", "KeyType": "RANGE"},
                ],
                "Projection": {"ProjectionType": "ALL"},
            }
        ],
        BillingMode="PAY_PER_REQUEST",
    )
    for _ in range(100):
        if dynamodb.describe_table(TableName=table)["Table"]["TableStatus"] == "ACTIVE":
            break
        time.sleep(0.1)
    dynamodb.update_time_to_live(
        TableName=table, TimeToLiveSpecification={"Enabled": True, "AttributeName": "ttl"}
    )
    print(f"created table {table}")
except ClientError as e:
    if e.response["Error"]["Code"] != "ResourceInUseException":
        raise
    print(f"table {table} exists")

try:
    logs.create_log_group(logGroupName=log_group)
    logs.put_retention_policy(logGroupName=log_group, retentionInDays=400)
    print(f"created log group {log_group}")
except ClientError as e:
    if e.response["Error"]["Code"] != "ResourceAlreadyExistsException":
        raise
    print(f"log group {log_group} exists")
sys.exit(0)
