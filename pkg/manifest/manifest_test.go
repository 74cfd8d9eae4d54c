package manifest

import (
	"errors"
	"fmt"
	"strings"
	"testing"
)

// workload wraps a pod template in the JSON of each kind that carries one.
func workload(kind, template string) string {
	switch kind {
	case "Pod":
		return `{"kind":"Pod","metadata":{"name":"x","namespace":"n",` + strings.TrimPrefix(template, `{"metadata":{`)
	case "CronJob":
		return `{"kind":"CronJob","metadata":{"name":"x","namespace":"n"},"spec":{"jobTemplate":{"spec":{"template":` + template + `}}}}`
	case "PodTemplate":
		return `{"kind":"PodTemplate","metadata":{"name":"x","namespace":"n"},"template":` + template + `}`
	}
	return fmt.Sprintf(`{"kind":%q,"metadata":{"name":"x","namespace":"n"},"spec":{"template":%s}}`, kind, template)
}

func TestEveryKindWithAPodTemplateIsChecked(t *testing.T) {
	valid := `{"metadata":{"annotations":{"gpu-fraction":"0.5"}},"spec":{"containers":[{"name":"main"}]}}`
	invalid := `{"metadata":{"annotations":{"gpu-fraction":"1.5"}},"spec":{"containers":[{"name":"main"}]}}`
	kinds := []string{"Pod", "Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "ReplicationController", "Job", "CronJob", "PodTemplate"}
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			objs, err := Decode(strings.NewReader(workload(kind, valid)), "f")
			if err != nil || len(objs) != 1 {
				t.Fatalf("Decode: %v, %d objects", err, len(objs))
			}
			obj := objs[0]
			if obj.Kind != kind || obj.Name != "x" || obj.Namespace != "n" || obj.Template == nil {
				t.Fatalf("object = %+v", obj)
			}
			reqs, _, err := Validate(obj)
			if err != nil || len(reqs) != 1 || reqs[0].Memory.Fraction.String() != "0.5" {
				t.Errorf("valid template: %v, %v", reqs, err)
			}
			bad := FromJSON(kind, []byte(workload(kind, invalid)))
			if _, _, err := Validate(bad); err == nil || !strings.Contains(err.Error(), `gpu-fraction "1.5" must be greater than 0 and less than 1`) {
				t.Errorf("invalid template: %v", err)
			}
		})
	}
}

func TestKindsWithoutTemplateAskForNothing(t *testing.T) {
	obj := FromJSON("ConfigMap", []byte(`{"kind":"ConfigMap","metadata":{"name":"c","annotations":{"gpu-fraction":"7"}}}`))
	if obj.Template != nil {
		t.Fatal("ConfigMap has a template")
	}
	if reqs, _, err := Validate(obj); reqs != nil || err != nil {
		t.Errorf("Validate = %v, %v", reqs, err)
	}
}

func TestWrongFieldTypeIsInvalidNotFatal(t *testing.T) {
	objs, err := Decode(strings.NewReader("kind: Deployment\nmetadata: {name: d}\nspec:\n  template:\n    spec:\n      containers: main\n"), "f")
	if err != nil || len(objs) != 1 {
		t.Fatalf("Decode: %v %v", objs, err)
	}
	_, _, err = Validate(objs[0])
	if err == nil || !strings.Contains(err.Error(), "cannot read as Deployment") {
		t.Errorf("Validate error = %v", err)
	}
}

func TestMisplacedAnnotationsOnlyWhenTemplateLacksThem(t *testing.T) {
	both := FromJSON("Deployment", []byte(`{"kind":"Deployment","metadata":{"name":"d","annotations":{"gpu-fraction":"0.5"}},
		"spec":{"template":{"metadata":{"annotations":{"gpu-fraction":"0.5"}},"spec":{"containers":[{"name":"m"}]}}}}`))
	if _, _, err := Validate(both); err != nil {
		t.Errorf("copy on the workload and the template: %v", err)
	}
	onlyWorkload := FromJSON("Job", []byte(`{"kind":"Job","metadata":{"name":"j","annotations":{"nvidia.com/container.m.gpu-memory.request":"1Gi"}},
		"spec":{"template":{"spec":{"containers":[{"name":"m"}]}}}}`))
	_, _, err := Validate(onlyWorkload)
	want := `metadata.annotations[nvidia.com/container.m.gpu-memory.request] "1Gi" is on the Job itself, where nothing reads it: move it to the pod template's metadata.annotations`
	if err == nil || err.Error() != want {
		t.Errorf("error = %v\nwant    %s", err, want)
	}
}

func TestNonStringAnnotationValues(t *testing.T) {
	tests := []struct{ yaml, want string }{
		{"kind: Pod\nmetadata:\n  annotations:\n    gpu-fraction: 0.5\n", `line 4: metadata.annotations[gpu-fraction] 0.5 is a number, not a string: quote it as "0.5"`},
		{"kind: Pod\nmetadata:\n  labels:\n    gpu: true\n", `line 4: metadata.labels[gpu] true is a boolean, not a string: quote it as "true"`},
		{"kind: Pod\nmetadata:\n  annotations:\n    gpu-memory:\n", `line 4: metadata.annotations[gpu-memory]  is a null, not a string: quote it as ""`},
		{"kind: Pod\nmetadata:\n  annotations:\n    gpu-memory: {a: 1}\n", `line 4: metadata.annotations[gpu-memory] is a nested structure, not a string`},
	}
	for _, tt := range tests {
		objs, err := Decode(strings.NewReader(tt.yaml), "f")
		if err != nil || len(objs) != 1 {
			t.Fatalf("Decode(%q): %v", tt.yaml, err)
		}
		if _, _, err := Validate(objs[0]); err == nil || err.Error() != tt.want {
			t.Errorf("Validate(%q) = %v\nwant %s", tt.yaml, err, tt.want)
		}
	}
}

func TestListsAndEmptyDocuments(t *testing.T) {
	in := "---\n---\nkind: PodList\nitems:\n- kind: Pod\n  metadata: {name: a}\n- kind: Pod\n  metadata: {name: b}\n---\n"
	objs, err := Decode(strings.NewReader(in), "f")
	if err != nil || len(objs) != 2 || objs[0].Name != "a" || objs[1].Name != "b" || objs[1].Line != 7 {
		t.Fatalf("Decode = %+v, %v", objs, err)
	}
}

// FuzzDecode: no input may panic the manifest reader or the validator, and
// every failure is a SyntaxError or an invalid object.
func FuzzDecode(f *testing.F) {
	f.Add("kind: Pod\nmetadata:\n  annotations:\n    gpu-fraction: \"0.5\"\nspec:\n  containers: [{name: main}]\n")
	f.Add(`{"kind":"List","items":[{"kind":"CronJob","spec":{"jobTemplate":{"spec":{"template":{"metadata":{"annotations":{"gpu-memory":"1"}}}}}}}]}`)
	f.Add("kind: Deployment\nspec: {template: {metadata: {annotations: {gpu-fraction: 0.5}}}}\n---\nkind: Job\n")
	f.Add("a: &x [*x]\n")
	f.Fuzz(func(t *testing.T, in string) {
		objs, err := Decode(strings.NewReader(in), "f")
		if err != nil {
			var syntax *SyntaxError
			if !errors.As(err, &syntax) {
				t.Fatalf("error %T %v is not a SyntaxError", err, err)
			}
		}
		for _, obj := range objs {
			reqs, _, err := Validate(obj)
			if err != nil && reqs != nil {
				t.Fatalf("requests and error together: %v %v", reqs, err)
			}
			for _, r := range reqs {
				if r.Devices < 1 || (r.Memory.IsFraction() != r.Limit.IsFraction()) {
					t.Fatalf("accepted request breaks invariants: %v", r)
				}
			}
		}
	})
}
