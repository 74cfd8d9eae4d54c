// Package manifest reads Kubernetes manifests (YAML or JSON, one or many
// documents) and finds the pod template in every object that carries one,
// so that pods and workloads are checked by the same rules.
package manifest

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpufrac/gpufrac/pkg/api"
)

// Object is one Kubernetes object found in a manifest.
type Object struct {
	Kind      string
	Namespace string
	Name      string
	// Line is where the object starts in its file (1-based).
	Line int
	// Meta is the object's own metadata.
	Meta metav1.ObjectMeta
	// Template is the pod template: the pod itself for a Pod; nil for kinds
	// that carry none.
	Template *corev1.PodTemplateSpec
	// Claim is the claim spec of a ResourceClaim, or of the claims a
	// ResourceClaimTemplate makes (ClaimPath says where it sits); nil for
	// other kinds.
	Claim     *resourceapi.ResourceClaimSpec
	ClaimPath string
	// Err is why the object could not be read as its kind (a field of the
	// wrong type, an annotation that is not a string).
	Err error
}

// SyntaxError says where a manifest stops being YAML or stops holding
// Kubernetes objects.
type SyntaxError struct {
	File string
	Line int
	Msg  string
}

func (e *SyntaxError) Error() string {
	if e.Line > 0 {
		return fmt.Sprintf("%s:%d: %s", e.File, e.Line, e.Msg)
	}
	return fmt.Sprintf("%s: %s", e.File, e.Msg)
}

// Decode reads every object of a YAML or JSON stream. file names the
// stream in errors. A *SyntaxError is returned for input that is not YAML
// or a document that is not a Kubernetes object; objects before it are
// returned too.
func Decode(r io.Reader, file string) ([]Object, error) {
	dec := yaml.NewDecoder(r)
	var objs []Object
	for {
		var doc yaml.Node
		err := dec.Decode(&doc)
		if errors.Is(err, io.EOF) {
			return objs, nil
		}
		if err != nil {
			return objs, yamlError(file, err)
		}
		if len(doc.Content) == 0 || isNull(doc.Content[0]) {
			continue // an empty document, e.g. a trailing "---"
		}
		found, err := fromNode(doc.Content[0], file)
		objs = append(objs, found...)
		if err != nil {
			return objs, err
		}
	}
}

var yamlLine = regexp.MustCompile(`^yaml: line (\d+): (.*)$`)

func yamlError(file string, err error) error {
	msg := err.Error()
	if m := yamlLine.FindStringSubmatch(msg); m != nil {
		line, _ := strconv.Atoi(m[1])
		return &SyntaxError{File: file, Line: line, Msg: m[2]}
	}
	return &SyntaxError{File: file, Msg: msg}
}

func isNull(n *yaml.Node) bool { return n.Kind == yaml.ScalarNode && n.Tag == "!!null" }

// header is what every Kubernetes object starts with.
type header struct {
	APIVersion string            `json:"apiVersion"`
	Kind       string            `json:"kind"`
	Metadata   metav1.ObjectMeta `json:"metadata"`
}

// fromNode turns one YAML document into objects: one, or each item of a List.
func fromNode(n *yaml.Node, file string) ([]Object, error) {
	if n.Kind != yaml.MappingNode {
		return nil, &SyntaxError{File: file, Line: n.Line, Msg: "not a Kubernetes object: the document is not a mapping"}
	}
	kind := scalarField(n, "kind")
	if kind == "" {
		return nil, &SyntaxError{File: file, Line: n.Line, Msg: "not a Kubernetes object: it has no kind"}
	}
	if kind == "List" || (strings.HasSuffix(kind, "List") && field(n, "items") != nil) {
		items := field(n, "items")
		if items == nil || items.Kind != yaml.SequenceNode {
			return nil, &SyntaxError{File: file, Line: n.Line, Msg: kind + " has no items sequence"}
		}
		var objs []Object
		for _, item := range items.Content {
			found, err := fromNode(item, file)
			objs = append(objs, found...)
			if err != nil {
				return objs, err
			}
		}
		return objs, nil
	}
	obj := Object{Kind: kind, Line: n.Line}
	if err := checkStringMaps(n, ""); err != nil {
		obj.Err = err
		obj.Name, obj.Namespace = scalarField(field(n, "metadata"), "name"), scalarField(field(n, "metadata"), "namespace")
		return []Object{obj}, nil
	}
	var generic any
	if err := n.Decode(&generic); err != nil {
		return nil, &SyntaxError{File: file, Line: n.Line, Msg: err.Error()}
	}
	raw, err := json.Marshal(generic)
	if err != nil {
		return nil, &SyntaxError{File: file, Line: n.Line, Msg: "not a Kubernetes object: " + err.Error()}
	}
	obj = FromJSON(kind, raw)
	obj.Line = n.Line
	return []Object{obj}, nil
}

// FromJSON reads one object of the given kind from its JSON form, as the
// API server sends it to admission webhooks.
func FromJSON(kind string, raw []byte) Object {
	var h header
	obj := Object{Kind: kind}
	if err := json.Unmarshal(raw, &h); err != nil {
		obj.Err = fmt.Errorf("metadata: %w", err)
		return obj
	}
	obj.Meta, obj.Name, obj.Namespace = h.Metadata, h.Metadata.Name, h.Metadata.Namespace
	if obj.Name == "" && h.Metadata.GenerateName != "" {
		obj.Name = h.Metadata.GenerateName + "*"
	}
	switch kind {
	case "ResourceClaim":
		var c resourceapi.ResourceClaim
		if err := json.Unmarshal(raw, &c); err != nil {
			obj.Err = fmt.Errorf("cannot read as %s: %w", kind, err)
		}
		obj.Claim, obj.ClaimPath = &c.Spec, "spec"
		return obj
	case "ResourceClaimTemplate":
		var c resourceapi.ResourceClaimTemplate
		if err := json.Unmarshal(raw, &c); err != nil {
			obj.Err = fmt.Errorf("cannot read as %s: %w", kind, err)
		}
		obj.Claim, obj.ClaimPath = &c.Spec.Spec, "spec.spec"
		return obj
	}
	template, err := podTemplate(kind, raw)
	if err != nil {
		obj.Err = err
		return obj
	}
	obj.Template = template
	return obj
}

// podTemplate decodes the kinds that carry a pod template.
func podTemplate(kind string, raw []byte) (*corev1.PodTemplateSpec, error) {
	decode := func(into any) error {
		if err := json.Unmarshal(raw, into); err != nil {
			return fmt.Errorf("cannot read as %s: %w", kind, err)
		}
		return nil
	}
	switch kind {
	case "Pod":
		var o corev1.Pod
		err := decode(&o)
		return &corev1.PodTemplateSpec{ObjectMeta: o.ObjectMeta, Spec: o.Spec}, err
	case "PodTemplate":
		var o corev1.PodTemplate
		err := decode(&o)
		return &o.Template, err
	case "Deployment":
		var o appsv1.Deployment
		err := decode(&o)
		return &o.Spec.Template, err
	case "StatefulSet":
		var o appsv1.StatefulSet
		err := decode(&o)
		return &o.Spec.Template, err
	case "DaemonSet":
		var o appsv1.DaemonSet
		err := decode(&o)
		return &o.Spec.Template, err
	case "ReplicaSet":
		var o appsv1.ReplicaSet
		err := decode(&o)
		return &o.Spec.Template, err
	case "ReplicationController":
		var o corev1.ReplicationController
		err := decode(&o)
		if o.Spec.Template == nil {
			return nil, err
		}
		return o.Spec.Template, err
	case "Job":
		var o batchv1.Job
		err := decode(&o)
		return &o.Spec.Template, err
	case "CronJob":
		var o batchv1.CronJob
		err := decode(&o)
		return &o.Spec.JobTemplate.Spec.Template, err
	}
	return nil, nil
}

// Validate checks an object's GPU-fraction request with the same rules as
// admission. It returns the normalised requests (nil when the object asks
// for no fraction) and admission's warnings, or why the object is invalid.
// Kinds without a pod template are valid and ask for nothing.
func Validate(obj Object) ([]api.Request, []string, error) {
	if obj.Err != nil {
		return nil, nil, obj.Err
	}
	if obj.Claim != nil {
		return nil, nil, ValidateClaim(*obj.Claim, obj.ClaimPath)
	}
	if obj.Template == nil {
		return nil, nil, nil
	}
	if err := misplacedAnnotations(obj); err != nil {
		return nil, nil, err
	}
	return api.Check(obj.Template.Annotations, &obj.Template.Spec)
}

// misplacedAnnotations catches fraction annotations written on a
// workload's own metadata: no component reads them there, so the pods
// would silently run without a GPU.
func misplacedAnnotations(obj Object) error {
	if obj.Kind == "Pod" {
		return nil
	}
	var errs api.ErrorList
	keys := make([]string, 0, len(obj.Meta.Annotations))
	for k := range obj.Meta.Annotations {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		if _, inTemplate := obj.Template.Annotations[k]; api.IsFractionKey(k) && !inTemplate {
			errs = append(errs, &api.FieldError{Key: "metadata.annotations[" + k + "]", Value: obj.Meta.Annotations[k],
				Rule: fmt.Sprintf("is on the %s itself, where nothing reads it: move it to the pod template's metadata.annotations", obj.Kind)})
		}
	}
	if len(errs) > 0 {
		return errs
	}
	return nil
}

// checkStringMaps finds annotation and label values that YAML typed as
// numbers or booleans (gpu-fraction: 0.5 without quotes): Kubernetes
// rejects them, and the message should say how to fix it.
func checkStringMaps(n *yaml.Node, path string) error {
	switch n.Kind {
	case yaml.MappingNode:
		for i := 0; i+1 < len(n.Content); i += 2 {
			key, value := n.Content[i], n.Content[i+1]
			p := key.Value
			if path != "" {
				p = path + "." + key.Value
			}
			if (key.Value == "annotations" || key.Value == "labels") && value.Kind == yaml.MappingNode {
				if err := checkStringValues(value, p); err != nil {
					return err
				}
				continue
			}
			if err := checkStringMaps(value, p); err != nil {
				return err
			}
		}
	case yaml.SequenceNode:
		for i, item := range n.Content {
			if err := checkStringMaps(item, fmt.Sprintf("%s[%d]", path, i)); err != nil {
				return err
			}
		}
	}
	return nil
}

func checkStringValues(m *yaml.Node, path string) error {
	for i := 0; i+1 < len(m.Content); i += 2 {
		key, value := m.Content[i], m.Content[i+1]
		if value.Kind != yaml.ScalarNode {
			return fmt.Errorf("line %d: %s[%s] is a nested structure, not a string", value.Line, path, key.Value)
		}
		if value.Tag != "!!str" {
			return fmt.Errorf("line %d: %s[%s] %s is a %s, not a string: quote it as %q",
				value.Line, path, key.Value, value.Value, tagName(value), value.Value)
		}
	}
	return nil
}

func tagName(n *yaml.Node) string {
	switch n.Tag {
	case "!!int", "!!float":
		return "number"
	case "!!bool":
		return "boolean"
	case "!!null":
		return "null"
	}
	return n.Tag
}

func field(n *yaml.Node, name string) *yaml.Node {
	if n == nil || n.Kind != yaml.MappingNode {
		return nil
	}
	for i := 0; i+1 < len(n.Content); i += 2 {
		if n.Content[i].Value == name {
			return n.Content[i+1]
		}
	}
	return nil
}

func scalarField(n *yaml.Node, name string) string {
	if f := field(n, name); f != nil && f.Kind == yaml.ScalarNode {
		return f.Value
	}
	return ""
}

// ValidateClaim is admission's check of a claim spec of gpufrac's DRA
// driver (api.ValidateClaim), with the fields named from path: "spec" for
// a ResourceClaim, "spec.spec" for a ResourceClaimTemplate.
func ValidateClaim(spec resourceapi.ResourceClaimSpec, path string) error {
	err := api.ValidateClaim(spec)
	if err == nil || path == "spec" {
		return err
	}
	return errors.New(strings.ReplaceAll(err.Error(), "spec.devices", path+".devices"))
}
