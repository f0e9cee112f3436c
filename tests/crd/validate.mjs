// Reads a JSON array of Kubernetes objects on stdin; validates each Prometheus Operator resource against
// its CRD's OpenAPI schema (types, enums, required fields) with @kubernetes-models. Prints one JSON line:
// {"checked": [kind/name...], "errors": [message...]}. Exit 1 when any resource fails.
import { readFileSync } from "node:fs";
import * as v1 from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1";

const docs = JSON.parse(readFileSync(0, "utf8"));
const checked = [];
const errors = [];
for (const doc of docs) {
  if (doc.apiVersion !== "monitoring.coreos.com/v1") continue;
  const Model = v1[doc.kind];
  if (!Model) {
    errors.push(`${doc.kind}: no model in @kubernetes-models/prometheus-operator`);
    continue;
  }
  try {
    new Model(doc).validate();
    checked.push(`${doc.kind}/${doc.metadata.name}`);
  } catch (e) {
    errors.push(`${doc.kind}/${doc.metadata.name}: ${e.message}`);
  }
}
console.log(JSON.stringify({ checked, errors }));
process.exit(errors.length ? 1 : 0);
