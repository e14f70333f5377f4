package kafkarecord_test

import "github.com/twmb/franz-go/pkg/kgo"

// kgoRecord builds a franz-go record from another client's headers.
type kgoRecord struct {
	topic   string
	headers []kgo.RecordHeader
}

func (r *kgoRecord) add(k string, v []byte) {
	r.headers = append(r.headers, kgo.RecordHeader{Key: k, Value: v})
}

func (r *kgoRecord) record(value []byte) *kgo.Record {
	return &kgo.Record{Topic: r.topic, Headers: r.headers, Value: value}
}
