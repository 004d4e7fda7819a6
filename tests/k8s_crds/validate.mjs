// Reads a JSON array of Kubernetes objects on stdin; prints [{kind, name, errors}] for the custom
// resources it knows (KEDA's ScaledObject, the Prometheus Operator's ServiceMonitor and PrometheusRule), each checked
// against the schema generated from that project's CRD. An unknown kind is reported, not skipped.
import { ScaledObject } from "@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject";
import { ServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor";
import { PrometheusRule } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PrometheusRule";

const models = {
  "keda.sh/v1alpha1/ScaledObject": ScaledObject,
  "monitoring.coreos.com/v1/ServiceMonitor": ServiceMonitor,
  "monitoring.coreos.com/v1/PrometheusRule": PrometheusRule,
};
const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
const results = JSON.parse(Buffer.concat(chunks).toString("utf8")).map((object) => {
  const Model = models[`${object.apiVersion}/${object.kind}`];
  const name = object.metadata?.name;
  if (!Model) return { kind: object.kind, name, errors: [`no schema for ${object.apiVersion} ${object.kind}`] };
  try {
    new Model(object).validate();
    return { kind: object.kind, name, errors: [] };
  } catch (error) {
    return { kind: object.kind, name, errors: [String(error.message)] };
  }
});
process.stdout.write(JSON.stringify(results));
